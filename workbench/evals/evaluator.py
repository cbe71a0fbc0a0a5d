"""Evaluating during a run: the configured eval hooks on the trained model, logged, and the best
checkpoint kept (train.keep_best).

    evaluator = Evaluator(run, run_dir, backend, tokenizer, contract, tracker, checkpoints)
    evaluator.evaluate("step", state)      # {} on ranks other than 0 and when eval.tasks is empty

The hooks and tasks are workbench/evals/'s; the best checkpoint's bookkeeping is
workbench/checkpoints/keep_best.py's.
"""

from __future__ import annotations

import time
from pathlib import Path

from workbench.checkpoints.keep_best import Keeper, metric_name
from workbench.compute import precision
from workbench.core import heartbeat
from workbench.evals import hooks
from workbench.train.state import TrainState


class Evaluator:
    def __init__(self, run, run_dir: Path, backend, tokenizer, contract, tracker, checkpoints):
        """`checkpoints`: where the trained weights go when a hook fails, and the best is copied from."""
        self.run, self.cfg, self.run_dir = run, run.cfg, run_dir
        self.backend, self.tokenizer, self.contract = backend, tokenizer, contract
        self.tracker, self.checkpoints = tracker, checkpoints
        self.best: Keeper | None = None  # made at the first evaluation that may keep a checkpoint
        self.cache: dict = {}  # eval data tokenised once per run

    def evaluate(self, tag: str, state: TrainState) -> dict:
        """Run the eval hooks on the current weights: start | step | end."""
        if not self.cfg.eval.tasks:
            return {}
        with heartbeat.phase("evaluation", tag):
            return self._run(tag, state)

    def _run(self, tag: str, state: TrainState) -> dict:
        cfg, run = self.cfg, self.run
        model = self.backend.gathered_model()  # a collective under sharding backends: None off rank 0
        if not run.layout.is_main:
            return {}
        t = time.perf_counter()
        try:
            with self.tracker.progress.status(f"eval [{tag}]"):  # spinner / bar text / plain lines
                res = hooks.run(model, self.tokenizer, self.contract, cfg.eval,
                                autocast=precision.autocast(run.precision, run.device), cfg=cfg,
                                step=state.step, tag=tag, run_dir=self.run_dir, cache=self.cache)
        except hooks.EvalHookError as exc:
            raise hooks.EvalHookError(f"{exc}; {self.checkpoints.keep_after_failed_hook(tag, state)}") from exc
        res["eval_seconds"] = time.perf_counter() - t
        self.tracker.log_eval(res, state.step)
        hooks.log_metrics(self.run_dir, res, state.step, tag)  # eval rows in metrics.jsonl carry `eval`
        if cfg.train.keep_best and tag != "start":  # copy this step's checkpoint to checkpoints/best/
            self._keep_best(res, state.step)
        self.tracker.console(f"eval ({tag}) " + ", ".join(f"{metric_name(k)}={v:.4g}" for k, v in res.items()
                                                          if k.startswith("eval/") and isinstance(v, float)
                                                          and not k.endswith("/seconds")))
        return res

    def _keep_best(self, res: dict, step: int) -> None:
        if self.best is None:
            self.best = Keeper(self.run_dir, self.cfg.train.keep_best, self.cfg.train.keep_best_mode)
        if self.best.update(res, step):
            self.tracker.console(f"best {metric_name(self.best.key)}={self.best.best['value']:.4g} at step "
                                 f"{step}: kept in {self.best.path}")
