import struct

import pytest

from qft import run
from qft.errors import QftError
from conftest import TINY_DATA, make_cfg

RUN = ["train.steps=3", "train.batch_size=4", "train.eval_every=2", "train.checkpoint_every=0", "train.zero_shot=false",
       *TINY_DATA]


def tensorboard_scalars(folder, tag):
    """Read scalars back from TFRecord event files: [u64 length][u32 crc][event][u32 crc] records."""
    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(folder.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return out


def test_tensorboard_gets_the_loss_curve(tmp_path):
    rec = run.run(make_cfg(*RUN, "logger=tensorboard"), tmp_path)
    got = tensorboard_scalars(tmp_path / "tensorboard", "train/loss")
    assert [s for s, _ in got] == [1, 2, 3]
    assert [v for _, v in got] == pytest.approx([l for _, l in rec["loss_curve"]], rel=1e-6)
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard", "val/accuracy")] == [2]
    assert tensorboard_scalars(tmp_path / "tensorboard", "final_accuracy/test")[0][1] == pytest.approx(
        rec["final_accuracy"]["test"])


def test_mlflow_gets_params_and_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    cfg = make_cfg(*RUN, "logger=mlflow", f"logger.tracking_uri={uri}")
    rec = run.run(cfg, tmp_path / "run")
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name("qft")
    (r,) = client.search_runs([exp.experiment_id])
    assert r.data.params["adapter.attn.r"] == "8" and r.data.tags["status"] == "ok"
    history = client.get_metric_history(r.info.run_id, "train/loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx([l for _, l in rec["loss_curve"]])


def test_unknown_logger_kind(tmp_path):
    with pytest.raises(QftError) as e:
        run.run(make_cfg(*RUN, "logger=tensorboard", "logger.kind=wandb"), tmp_path)
    assert e.value.key == "logger.kind"
