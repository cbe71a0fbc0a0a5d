"""Tolerances of the golden and parity tests, derived once from the arithmetic, not from a machine.

The runs these tests compare compute the same fp32 sums in another order: another CPU's kernels
(AVX2, AVX-512, AMX), another thread count, 1 rank against 2, tensor-parallel splits, our masked
`index_add` against TRL's masked sums. fp32 rounds to eps = 2**-23 = 1.19e-7 relative, and
reordering a blocked or pairwise sum of n terms moves it by about log2(n) roundings of its
largest partial sum. The longest sums in a step run over the vocabulary, V = 49,152 < 2**16, so
one evaluation moves by up to SUM_ULPS = 16 ulps, 1.9e-6 relative.

- LOSS_RTOL (losses that are means of positive terms: cross-entropy, -log sigmoid): 16 ulps for
  evaluating the loss plus the drift carried through the (at most four) optimizer updates
  before it; 1e-5 = 84 ulps. Cross-check: AVX2 on 1 thread against AVX-512 on 2 threads
  (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=1) moved the golden
  curves by at most 1.5e-6 relative.
- NEAR_ZERO_ATOL (GRPO losses): a signed mean of per-token terms A_i * ratio_i whose size is that
  of the group-normalised advantages (|A| ~ 1); they cancel (on-policy step 1 is 0 up to
  rounding), so the rounding scales with the terms, not with the loss: 16 ulps of 1.0, 1.9e-6.
  Same cross-check: at most 2.5e-7. Steps 2-4 of the GRPO curves are 3e-3 to 4e-2, so a change
  of the formula still shows.
- grad_atol(ref): a gradient element sums products over tokens and, at the head, over the
  vocabulary; its rounding scales with the largest elements of that gradient, not with itself
  (small elements are differences of large products): LOSS_RTOL times the largest |element|.
- The resume certificate (workbench/train/replay.py, whose constants must equal these): the loss of
  one fixed micro-batch, forward only, under the same weights in another layout. In fp32 only the
  summation order differs, the LOSS_RTOL case. With bf16 or fp16 compute every matmul output is
  rounded to bf16 at worst (EPS_BF16 = 2**-8 relative a rounding) and another summation order can
  move a rounding by one ulp: a token's cross-entropy lse(z) - z_y moves by twice the largest
  logit change, and the logits carry one more rounding from the hidden state entering the head
  and one from the final norm, so PROBE_RTOL_HALF = 4 bf16 ulps, relative to the logits' scale,
  which the probe's loss (about log V on random tokens) exceeds.
"""

from __future__ import annotations

EPS32 = 2.0**-23
SUM_ULPS = 16
LOSS_RTOL = 1e-5
NEAR_ZERO_ATOL = SUM_ULPS * EPS32
EPS_BF16 = 2.0**-8
PROBE_RTOL_HALF = 4 * EPS_BF16


def grad_atol(ref) -> float:
    return LOSS_RTOL * float(ref.abs().max())
