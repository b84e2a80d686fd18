"""Optional experiment tracking: every run's config, loss curve and accuracies to TensorBoard or MLflow.

The result record stays the source of truth; a tracker is a view for people who browse runs there.
"""

from __future__ import annotations

from pathlib import Path

from qft import schema
from qft.errors import QftError



def check(cfg) -> None:
    """Check logger group `cfg`; raises QftError naming the key."""
    schema.check(cfg, "logger")


class Tracker:
    """A no-op tracker; the subclasses send the same three calls somewhere."""

    def params(self, flat: dict) -> None: ...

    def metrics(self, values: dict, step: int) -> None: ...

    def close(self, status: str) -> None: ...


class TensorBoard(Tracker):
    """Event files in `folder`; raises QftError (logger.kind) where neither torch's writer nor tensorboardX is
    installed."""

    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise QftError("logger.kind", "tensorboard", "needs tensorboard or tensorboardX: pip install tensorboardX") from e
        self.writer = SummaryWriter(str(folder))

    def params(self, flat: dict) -> None:
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(flat.items())))

    def metrics(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()


class MLflow(Tracker):
    """An MLflow run named `run_name` in `experiment`, at logger group `cfg`'s tracking URI; raises QftError
    (logger.kind) without mlflow."""

    def __init__(self, cfg, run_name: str, experiment: str):
        try:
            import mlflow
        except ImportError as e:
            raise QftError("logger.kind", "mlflow", "needs mlflow: pip install mlflow-skinny") from e
        self.mlflow = mlflow
        if cfg.tracking_uri:
            mlflow.set_tracking_uri(cfg.tracking_uri)
        mlflow.set_experiment(cfg.experiment or experiment)
        self.run = mlflow.start_run(run_name=run_name)

    def params(self, flat: dict) -> None:
        self.mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def metrics(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self, status: str) -> None:
        self.mlflow.set_tag("status", status)
        self.mlflow.end_run(status="FINISHED" if status == "ok" else "FAILED")


def make(cfg, run_dir: Path, experiment: str | None) -> Tracker:
    """The tracker logger group `cfg` asks for (tensorboard under `run_dir` by default, mlflow in `experiment`), or the
    no-op Tracker."""
    if cfg.kind == "tensorboard":
        return TensorBoard(Path(cfg.dir) if cfg.get("dir") else run_dir / "tensorboard")
    if cfg.kind == "mlflow":
        return MLflow(cfg, run_dir.name, experiment or "qft")
    return Tracker()
