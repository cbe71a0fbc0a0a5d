"""Evaluating during a run: the configured eval hooks on the trained model, logged, and the best
checkpoint kept (train.keep_best).

    evaluator = Evaluator(runner)
    evaluator.evaluate("step")      # {} on ranks other than 0 and when eval.tasks is empty

The hooks and tasks are workbench/evals/'s; the best checkpoint's bookkeeping is
workbench/train/keep_best.py's.
"""

from __future__ import annotations

import time

from workbench.core import heartbeat
from workbench.evals import hooks
from workbench.train import precision
from workbench.train.keep_best import Keeper


class Evaluator:
    def __init__(self, r):
        self.r = r  # the runner: its model, state and tracker change over the run
        self.best: Keeper | None = None  # made at the first evaluation that may keep a checkpoint
        self.cache: dict = {}  # eval data tokenised once per run

    def evaluate(self, tag: str) -> dict:
        """Run the eval hooks on the current weights: start | step | end."""
        if not self.r.cfg.eval.tasks:
            return {}
        with heartbeat.phase("evaluation", tag):
            return self._run(tag)

    def _run(self, tag: str) -> dict:
        r, cfg = self.r, self.r.cfg
        model = r.backend.gathered_model()  # a collective under sharding backends: None off rank 0
        if not r.is_main:
            return {}
        t = time.perf_counter()
        try:
            with r.tracker.progress.status(f"eval [{tag}]"):  # spinner / bar text / plain lines
                res = hooks.run(model, r.tokenizer, r.contract, cfg.eval,
                                autocast=precision.autocast(r.run.precision, r.device), cfg=cfg,
                                step=r.state.step, tag=tag, run_dir=r.run_dir, cache=self.cache)
        except hooks.EvalHookError as exc:
            raise hooks.EvalHookError(f"{exc}; {r.checkpoints.keep_after_failed_hook(tag, r.state)}") from exc
        res["eval_seconds"] = time.perf_counter() - t
        r.tracker.log_eval(res, r.state.step)
        hooks.log_metrics(r.run_dir, res, r.state.step, tag)  # eval rows in metrics.jsonl carry `eval`
        if cfg.train.keep_best and tag != "start":  # copy this step's checkpoint to checkpoints/best/
            self._keep_best(res)
        r.tracker.console(f"eval ({tag}) " + ", ".join(f"{k[5:]}={v:.4g}" for k, v in res.items()
                                                       if k.startswith("eval/") and isinstance(v, float)
                                                       and not k.endswith("/seconds")))
        return res

    def _keep_best(self, res: dict) -> None:
        r = self.r
        if self.best is None:
            self.best = Keeper(r.run_dir, r.cfg.train.keep_best, r.cfg.train.keep_best_mode)
        if self.best.update(res, r.state.step):
            r.tracker.console(f"best {self.best.key[5:]}={self.best.best['value']:.4g} at step "
                              f"{r.state.step}: kept in {self.best.path}")
