"""`python -m workbench.serve` driven by the unmodified Tinker SDK (`tinker` 0.38.0): a LoRA
training client on model=tiny, forward_backward with the SDK's cross_entropy, optim_step with its
AdamParams, the loss falling; sampler weights and samples with log-probs; save_state and
load_state; a request the service cannot honour as one error; the service stopped or killed
mid-future as an error in bounded time, never a hang.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/integration/test_tinker_service.py

The service is a child process on a free loopback port (serve.port=0; it writes the port to
<run>/serve.json). The SDK retries a lost connection with backoff and without end, so every
wait here has a timeout: what a client of a service that can die should do too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import dist_env

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

WAIT = 60  # seconds any one SDK call may take here (a few on this machine)
KEY = "tml-workbench-test-key-not-a-secret"


def launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    """The service as a child process (model=tiny, a free port)."""
    env = {**dist_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "workbench.serve", "model=tiny", "precision=fp32",
                             "serve.port=0", f"output_dir={run_dir}", *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ready(proc: subprocess.Popen, run_dir: Path) -> str:
    """The base URL once the service listens (it writes <run>/serve.json then)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the service exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        if (run_dir / "serve.json").exists():
            return json.loads((run_dir / "serve.json").read_text())["url"]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the service did not listen within 120 s")


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.stdout.read()


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    """The SDK's telemetry off, as the guide advises for this service (which drops it): on a
    failed request the SDK flushes it to the server before raising, and with the server gone
    that flush waits out its own 30 s timeout (tinker/lib/telemetry.py FLUSH_TIMEOUT)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


CLIENTS: list = []


def client(url: str):
    """A ServiceClient that is closed after the test (the `closed` fixture)."""
    CLIENTS.append(tinker.ServiceClient(base_url=url, api_key=KEY))
    return CLIENTS[-1]


@pytest.fixture(autouse=True)
def closed():
    """Each test's SDK sessions finished when it ends: an open one keeps its heartbeat thread, which
    warns every few minutes for the rest of the suite once the service has gone. Against a service
    that is gone already the finish cannot be sent, and the SDK's own close is not waited for."""
    yield
    while CLIENTS:
        sc = CLIENTS.pop()
        try:
            sc.close("success").result(timeout=10)
        except Exception:  # the service was stopped or killed by the test: the SDK would retry the
            # finish for minutes before closing its holders, so they are closed here (no request)
            for holder in (sc._session_holder, sc._rest_holder):
                if holder is not None:
                    holder.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve")
    proc = launch(run_dir)
    yield ready(proc, run_dir), run_dir
    stop(proc)


def datums(n: int = 4) -> list:
    """Sequences the tiny random model can learn in a few steps: the same tokens every time."""
    out = []
    for i in range(n):
        toks = [11 + i, 500, 501, 502, 503, 504, 505, 506, 507]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "weights": [0.0] + [1.0] * 7}))
    return out


def test_train_sample_save_load(service):
    url, run_dir = service
    sc = client(url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result(timeout=WAIT)
    info = tc.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == "tiny"
    assert len(tc.get_tokenizer().encode("2+2=4")) > 0  # the tokenizer the service saved in its run dir

    data = datums()
    losses = []
    for _ in range(4):  # submitted back to back, collected after: the service runs them in order
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        out = fb.result(timeout=WAIT)
        assert opt.result(timeout=WAIT).metrics["grad_norm:mean"] > 0
        losses.append(out.metrics["loss:sum"])
        lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
        assert lp.shape == (8,) and (lp <= 0).all()
    assert losses[-1] < losses[0] - 1.0, losses  # the summed NLL of 28 tokens falls

    saved = tc.save_state("after-4").result(timeout=WAIT)
    assert saved.path.endswith("/weights/after-4")
    at_save = tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]

    sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
    res = sampler.sample(types.ModelInput.from_ints([11, 500, 501]), 2,
                         types.SamplingParams(max_tokens=4, temperature=1.0, seed=1),
                         include_prompt_logprobs=True).result(timeout=WAIT)
    assert len(res.sequences) == 2
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs) and seq.stop_reason in ("stop", "length")
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == 3
    # the sampler's log-probs are the trained weights': forward on what it sampled gives the same
    prompt = [11, 500, 501]
    greedy = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                            types.SamplingParams(max_tokens=3, temperature=0.0)).result(timeout=WAIT).sequences[0]
    full = prompt + greedy.tokens
    check = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    trained = tc.forward([check], "cross_entropy").result(timeout=WAIT).loss_fn_outputs[0]["logprobs"].to_numpy()
    assert trained[-len(greedy.tokens):].tolist() == pytest.approx(greedy.logprobs, abs=1e-4)

    named = tc.save_weights_for_sampler("adapter-4").result(timeout=WAIT)
    folder = run_dir / "checkpoints" / tc.model_id.replace(":", "_") / "sampler_weights" / "adapter-4"
    assert (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    again = sc.create_sampling_client(model_path=named.path).result(timeout=WAIT)
    same = again.sample(types.ModelInput.from_ints(prompt), 1,
                        types.SamplingParams(max_tokens=3, temperature=0.0)).result(timeout=WAIT)
    assert same.sequences[0].tokens == greedy.tokens
    assert same.sequences[0].logprobs == pytest.approx(greedy.logprobs, abs=1e-4)

    # two more steps move the weights; load_state brings back the saved ones (and AdamW's state)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=WAIT)
    moved = tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
    assert moved != pytest.approx(at_save, abs=1e-4)
    with pytest.warns(FutureWarning):  # the SDK deprecates load_state in favour of the two below
        tc.load_state_with_optimizer(saved.path).result(timeout=WAIT)
    assert tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"] == pytest.approx(at_save, abs=1e-4)
    resumed = sc.create_training_client_from_state_with_optimizer(saved.path).result(timeout=WAIT)
    assert resumed.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"] == pytest.approx(at_save, abs=1e-4)

    # the run directory: a metrics line per forward_backward and optim_step, the manifest
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mine = [r for r in rows if r["model_id"] == tc.model_id]
    assert [r["event"] for r in mine].count("forward_backward") == 6
    assert [r["event"] for r in mine].count("optim_step") == 6
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["served_model"] == "tiny" and manifest["versions"]["tinker"] == tinker.__version__
    assert any(e["event"] == "save_state" and e["path"] == saved.path for e in manifest["events"])
    text = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file() and p.suffix in
                   (".json", ".jsonl", ".log", ".txt", ".yaml"))
    assert KEY not in text  # the API key the SDK sent is nowhere on disk


def test_rl_losses(service):
    """importance_sampling and ppo on the model's own log-probs shifted by a known amount: the
    ratio is exp(-shift), so the sums (and ppo's clip at its thresholds) are known exactly."""
    import numpy as np

    url, _ = service
    tc = client(url).create_lora_training_client(
        base_model="tiny", rank=4, seed=1).result(timeout=WAIT)
    data = datums(2)
    own = [o["logprobs"].to_numpy() for o in tc.forward(data, "cross_entropy").result(timeout=WAIT).loss_fn_outputs]
    n = sum(len(lp) for lp in own)

    def rl(shift: float, adv: float) -> list:
        return [types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": (lp + shift).astype(np.float32),
            "advantages": np.full(len(lp), adv, dtype=np.float32)}) for d, lp in zip(data, own)]

    def loss(name: str, shift: float, adv: float, **config) -> float:
        return tc.forward(rl(shift, adv), name, config or None).result(timeout=WAIT).metrics["loss:sum"]

    r = float(np.exp(-0.5))  # 0.61: below ppo's default low clip 0.8
    assert loss("importance_sampling", 0.0, 1.0) == pytest.approx(-n, rel=1e-4)
    assert loss("importance_sampling", 0.5, 2.0) == pytest.approx(-2 * r * n, rel=1e-4)
    assert loss("ppo", 0.5, 1.0) == pytest.approx(-r * n, rel=1e-4)  # min(r A, 0.8 A) = r A
    assert loss("ppo", 0.5, -1.0) == pytest.approx(0.8 * n, rel=1e-4)  # min(-r, -0.8) = -0.8
    assert loss("ppo", 0.5, -1.0, clip_low_threshold=0.5) == pytest.approx(r * n, rel=1e-4)
    out = tc.forward_backward(rl(0.0, 1.0), "ppo").result(timeout=WAIT)
    assert out.metrics["loss:sum"] == pytest.approx(-n, rel=1e-4)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=WAIT).metrics["grad_norm:mean"] > 0


def test_unsupported_requests_are_one_error(service):
    url, _ = service
    sc = client(url)
    t0 = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="not served here; this service serves tiny"):
        sc.create_lora_training_client(base_model="Qwen/Qwen3-8B").result(timeout=WAIT)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result(timeout=WAIT)
    # "dro" is a loss the SDK knows; the service names the ones it has
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'dro' is not served here.*cross_entropy"):
        tc.forward_backward(datums(1), "dro").result(timeout=WAIT)
    with pytest.raises(tinker.RequestFailedError, match="not a checkpoint path of this service|no such checkpoint"):
        sc.create_training_client_from_state("tinker://elsewhere/weights/x").result(timeout=WAIT)
    assert time.monotonic() - t0 < 30  # errors, not retries


def test_stopped_or_killed_service_is_an_error_not_a_hang(tmp_path):
    """Mid-future (every forward_backward made to take a minute), two services started side by side:
    - SIGTERM: the service fails the waiting future before it goes ("the service is stopping"),
      so the client's wait ends with that error at once;
    - SIGKILL: nothing can answer, and the SDK retries a lost connection forever, so the client's
      own timeout bounds the wait (TimeoutError)."""
    procs = {sig: launch(tmp_path / sig.name, "debug.step_sleep_s=60") for sig in (signal.SIGTERM, signal.SIGKILL)}
    try:
        futures = {}
        for sig, proc in procs.items():
            url = ready(proc, tmp_path / sig.name)
            tc = client(url).create_lora_training_client(
                base_model="tiny", rank=4).result(timeout=WAIT)
            futures[sig] = tc.forward_backward(datums(1), "cross_entropy")
        time.sleep(2)  # submitted, running, the clients polling
        procs[signal.SIGTERM].send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="the service is stopping"):
            futures[signal.SIGTERM].result(timeout=WAIT)
        assert time.monotonic() - t0 < 10
        procs[signal.SIGKILL].kill()
        procs[signal.SIGKILL].wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            futures[signal.SIGKILL].result(timeout=5)
        assert time.monotonic() - t0 < 10
    finally:
        out = {sig: stop(proc) for sig, proc in procs.items()}
    assert "unfinished request(s) failed" in out[signal.SIGTERM], out[signal.SIGTERM]
