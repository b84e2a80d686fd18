"""The pipeline-offload simulator: closed forms, policy orderings, memory bounds, routing, bad input."""

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from qft.tools import simulate as S
from qft.errors import QftError

ROOT = Path(__file__).resolve().parent.parent
INF = math.inf


def server(n=4, pcie=INF, nvlink=INF, mem=1e12, shared=False, latency=0.0, pairs=None):
    return S.Server(n_gpus=n, gpu_memory_bytes=mem, pcie_bandwidth=pcie, nvlink_bandwidth=nvlink,
                    nvlink_pairs=[(i, i + 1) for i in range(0, n - 1, 2)] if pairs is None else pairs,
                    shared_uplink=shared, pcie_latency_s=latency, nvlink_latency_s=latency)


def uniform(p, m, schedule="1f1b", f=1.0, b=2.0, act=10.0, fixed=100.0, boundary=0.0):
    return S.Workload([S.Stage(f, b, act, fixed, boundary) for _ in range(p)], m, schedule)


@pytest.mark.parametrize("schedule", S.SCHEDULES)
@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 1), (3, 2), (4, 4), (4, 9), (6, 3)])
def test_makespan_and_bubble_match_the_closed_form(schedule, p, m):
    f, b = 1.0, 2.0
    r = S.simulate(server(max(p, 2)), uniform(p, m, schedule, f, b), "none")
    assert r.makespan == pytest.approx((m + p - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.compute_busy == pytest.approx([m * (f + b)] * p)


@pytest.mark.parametrize("p,m", [(4, 2), (4, 4), (4, 8), (6, 5)])
def test_peak_in_flight_micro_batches(p, m):
    act, fixed = 10.0, 100.0
    one = S.simulate(server(p), uniform(p, m, "1f1b", act=act, fixed=fixed), "none")
    assert one.peak_inflight == [min(m, p - s) for s in range(p)]
    assert one.peak_memory == pytest.approx([fixed + min(m, p - s) * act for s in range(p)])
    gp = S.simulate(server(p), uniform(p, m, "gpipe", act=act, fixed=fixed), "none")
    assert gp.peak_inflight == [m] * p
    assert gp.peak_memory == pytest.approx([fixed + m * act] * p)


def test_timeline_is_consistent():
    srv = server(4, pcie=5e9, nvlink=20e9, latency=1e-5)
    wl = uniform(4, 6, act=3e9, fixed=1e9, boundary=1e8, f=0.2, b=0.4)
    r = S.simulate(srv, wl, S.Policy("neighbour", stages=(0, 1, 2), neighbour_share=0.5))
    by_res = {}
    for e in r.timeline:
        assert e.end >= e.start >= 0
        by_res.setdefault(e.resource, []).append(e)
    for res, evs in by_res.items():  # one stream / one link direction does one thing at a time
        evs.sort(key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(evs, evs[1:])), res
    for s in range(4):
        comp = by_res[f"stage{s}"]
        assert sorted((e.kind, e.micro_batch) for e in comp) == sorted(
            [("F", i) for i in range(6)] + [("B", i) for i in range(6)])
    assert max(e.end for e in r.timeline) == pytest.approx(r.makespan)
    for name, busy in r.link_busy.items():
        assert busy == pytest.approx(sum(e.end - e.start for e in by_res.get(name, [])))


def random_case(rng):
    p = rng.randint(1, 5)
    n = p + (p % 2) + rng.choice([0, 2])
    srv = S.Server(n_gpus=n, gpu_memory_bytes=rng.uniform(5, 40) * S.GB, pcie_bandwidth=rng.uniform(2, 30) * S.GB,
                   nvlink_pairs=[(i, i + 1) for i in range(0, n, 2)], nvlink_bandwidth=rng.uniform(10, 60) * S.GB,
                   shared_uplink=rng.random() < 0.3, pcie_latency_s=1e-5, nvlink_latency_s=5e-6)
    stages = [S.Stage(rng.uniform(0.05, 0.5), rng.uniform(0.05, 1.0), rng.uniform(0.1, 8) * S.GB,
                      rng.uniform(0.5, 4) * S.GB, rng.uniform(0, 0.1) * S.GB) for _ in range(p)]
    wl = S.Workload(stages, rng.randint(1, 10), rng.choice(S.SCHEDULES))
    off = tuple(sorted(rng.sample(range(p), rng.randint(1, p))))
    return srv, wl, off, rng.choice([1.0, 0.5, "auto"]), rng.choice([None, rng.random()])


@pytest.mark.parametrize("seed", range(30))
def test_policy_ordering_on_random_servers(seed):
    srv, wl, off, frac, share = random_case(random.Random(seed))
    r = S.compare(srv, wl, off, frac, share)
    t = {k: v.makespan for k, v in r.items()}
    eps = 1e-9 * t["none"]
    assert t["sync"] >= t["none"] - eps  # copying on the compute stream never helps
    assert t["overlap"] <= t["sync"] + eps  # the same copies, off the compute stream
    assert t["neighbour"] <= t["sync"] + eps
    assert t["overlap"] >= t["none"] - eps


def test_sync_strictly_slower_when_copies_cost_time():
    srv, wl = server(4, pcie=1e9), uniform(4, 8, act=1e9, fixed=1e9)
    r = S.compare(srv, wl, stages=(0, 1))
    # two stages each pay a 1 s copy out and back per micro-batch on the compute stream
    assert r["sync"].makespan > r["none"].makespan + 8
    assert r["sync"].peak_memory[0] == pytest.approx(1e9 + 1e9)  # one micro-batch resident at a time
    assert r["overlap"].makespan < r["sync"].makespan


@pytest.mark.parametrize("schedule", S.SCHEDULES)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_infinite_bandwidth_overlap_is_free_and_bounds_memory(schedule, fraction):
    p, m, act, fixed = 4, 8, 10.0, 100.0
    wl = uniform(p, m, schedule, act=act, fixed=fixed)
    none = S.simulate(server(p), wl, "none")
    for kind in ("overlap", "neighbour"):
        r = S.simulate(server(p), wl, S.Policy(kind, stages=tuple(range(p)), fraction=fraction))
        assert r.makespan == pytest.approx(none.makespan)
        for s in range(p):
            resident = (1 - fraction) * act * none.peak_inflight[s]
            # fixed + what stays + the forward being produced + one prefetch buffer
            assert r.peak_memory[s] <= fixed + resident + act + fraction * act + 1e-9
        if fraction == 1.0:
            assert r.peak_memory[0] < none.peak_memory[0]
            assert r.peak_memory[0] <= fixed + 2 * act + 1e-9


def test_neighbour_relays_over_nvlink_and_relieves_the_busy_pcie_link():
    srv = server(2, pcie=2e9, nvlink=50e9, latency=1e-5)
    wl = uniform(2, 8, act=2e9, fixed=1e9, f=0.3, b=0.6)  # 1 s of copy out per 0.9 s of compute: PCIe-bound
    ov = S.simulate(srv, wl, S.Policy("overlap", stages=(0,)))
    nb = S.simulate(srv, wl, S.Policy("neighbour", stages=(0,)))  # partner stage 1 does not offload: share 1/2
    assert nb.link_busy["nvlink0>1"] == pytest.approx(8 * 1e9 / 50e9, rel=0.05)  # half of each offload
    assert nb.link_busy["nvlink1>0"] == pytest.approx(8 * 1e9 / 50e9, rel=0.05)  # and of each prefetch
    assert ov.link_busy["nvlink0>1"] == 0
    assert nb.link_busy["pcie0.d2h"] < 0.6 * ov.link_busy["pcie0.d2h"]
    assert nb.link_busy["pcie1.d2h"] > 0.4 * ov.link_busy["pcie0.d2h"]
    # the bytes to host are conserved, only split over two links
    assert nb.link_busy["pcie0.d2h"] + nb.link_busy["pcie1.d2h"] == pytest.approx(ov.link_busy["pcie0.d2h"], rel=1e-3)
    assert nb.makespan < ov.makespan
    assert nb.peak_memory[1] <= 1e9 + 1 * 2e9 + S.RELAY_SLOTS * 64 * 2**20 + 1  # relay staging stays small


def test_shared_uplink_leaves_nothing_to_relay():
    srv = server(2, pcie=2e9, nvlink=50e9, shared=True)
    wl = uniform(2, 8, act=2e9, fixed=1e9, f=0.3, b=0.6)
    nb = S.simulate(srv, wl, S.Policy("neighbour", stages=(0,)))
    assert nb.link_busy["nvlink0>1"] == 0 and "pcie0+1.d2h" in nb.link_busy
    own = S.simulate(server(2, pcie=2e9, nvlink=50e9), wl, S.Policy("sync", stages=(0, 1)))
    shared = S.simulate(srv, wl, S.Policy("sync", stages=(0, 1)))
    assert shared.makespan >= own.makespan


def test_auto_stages_and_fraction_fit_the_gpu():
    srv = server(4, pcie=10e9, nvlink=50e9, mem=30e9, latency=1e-5)
    wl = uniform(4, 8, act=10e9, fixed=5e9, f=0.5, b=1.0)  # in flight 4,3,2,1 x 10 GB: stages 0, 1 do not fit
    r = S.simulate(srv, wl, S.Policy("overlap", fraction="auto"))
    assert r.offload_stages == [0, 1]
    assert all(r.fits) and 0 < r.fractions[0] < 1 and r.fractions[2] == 0
    assert not all(S.simulate(srv, wl, "none").fits)


def test_mirror_placement_pairs_heavy_with_light_stages():
    srv = server(4)
    assert S.placement_of("mirror", 4, srv) == [0, 2, 3, 1]
    assert S.placement_of("pipeline", 4, srv) == [0, 1, 2, 3]
    r = S.simulate(server(4, pcie=5e9, nvlink=50e9), uniform(4, 4, act=1e9, boundary=1e8),
                   S.Policy("neighbour", stages=(0,)), placement="mirror")
    assert r.gpu_of_stage == [0, 2, 3, 1] and r.link_busy["nvlink0>1"] > 0  # stage 0 relays through stage 3


def test_workload_from_model_follows_the_formulas():
    wl = S.workload_from_model("llama2-7b", 4, 16, micro_batch_size=2, seq_len=1024, tflops=50e12)
    s, b, h, a = 1024, 2, 4096, 32
    assert wl.stages[0].act_bytes == pytest.approx(8 * s * b * h * (34 + 5 * a * s / h))
    assert wl.stages[1].boundary_bytes == 2 * s * b * h
    fwd = 8 * (2 * (4 * h * h + 3 * h * 11008) * s * b + 4 * b * s * s * h) / 50e12
    assert wl.stages[1].fwd_s == pytest.approx(fwd) and wl.stages[1].bwd_s == pytest.approx(2 * fwd)
    assert wl.tokens_per_step == 16 * 2 * 1024
    nf4 = sum(st.fixed_bytes for st in wl.stages) - 4 * 2**30
    assert 3.5e9 < nf4 < 5.5e9  # 6.5 B NF4 params ~ 3.4 GB + bf16 embedding/head + LoRA states
    flash = S.workload_from_model("llama2-13b", 8, 8, flash_attention=True)
    assert flash.stages[2].act_bytes == pytest.approx(5 * 2048 * 5120 * 34)


BAD = [
    (lambda: S.Server(n_gpus=0, gpu_memory_bytes=1, pcie_bandwidth=1), "server.n_gpus"),
    (lambda: S.Server(n_gpus=2, gpu_memory_bytes=1, pcie_bandwidth=-5), "server.pcie_bandwidth"),
    (lambda: S.Server(n_gpus=2, gpu_memory_bytes=0, pcie_bandwidth=1), "server.gpu_memory_bytes"),
    (lambda: S.Server(n_gpus=2, gpu_memory_bytes=1, pcie_bandwidth=1, nvlink_pairs=[(0, 0)], nvlink_bandwidth=1),
     "server.nvlink_pairs"),
    (lambda: S.Server(n_gpus=3, gpu_memory_bytes=1, pcie_bandwidth=1, nvlink_pairs=[(0, 1), (1, 2)],
                      nvlink_bandwidth=1), "server.nvlink_pairs"),
    (lambda: S.Server(n_gpus=2, gpu_memory_bytes=1, pcie_bandwidth=1, nvlink_pairs=[(0, 1)]),
     "server.nvlink_bandwidth"),
    (lambda: S.Workload([S.Stage(-1, 1, 1, 1)], 2), "workload.stages[0].fwd_s"),
    (lambda: S.Workload([S.Stage(1, 1, 1, 1)], 0), "workload.micro_batches"),
    (lambda: S.Workload([S.Stage(1, 1, 1, 1)], 2, "zb-h1"), "workload.schedule"),
    (lambda: S.Workload([], 2), "workload.stages"),
    (lambda: S.Policy("async"), "policy.kind"),
    (lambda: S.Policy("sync", fraction=1.5), "policy.fraction"),
    (lambda: S.Policy("neighbour", neighbour_share=-0.1), "policy.neighbour_share"),
    (lambda: S.simulate(server(2), uniform(2, 2), S.Policy("sync", stages=(5,))), "policy.stages"),
    (lambda: S.simulate(server(2), uniform(3, 2), "none"), "workload.stages"),
    (lambda: S.simulate(server(4), uniform(3, 2), "none", placement="mirror"), "placement"),
    (lambda: S.server_from_dict({"n_gpus": 2, "gpu_memory_bytes": 1, "pcie_bw": 1}), "server.pcie_bw"),
    (lambda: S.workload_from_model("gpt-5", 4, 8), "model"),
    (lambda: S.workload_from_dict({"model": "llama2-7b", "stages": 4, "micro_batch": 8}), "workload.micro_batch"),
    # integers are ints (a YAML "2" read as 2.0 used to pass here and crash the simulation), times are finite
    (lambda: S.Server(n_gpus=2.0, gpu_memory_bytes=1, pcie_bandwidth=1), "server.n_gpus"),
    (lambda: S.Server(n_gpus=2, gpu_memory_bytes=1, pcie_bandwidth=1, pcie_latency_s=INF), "server.pcie_latency_s"),
    (lambda: S.Server(n_gpus=2, gpu_memory_bytes=1, pcie_bandwidth=1, shared_uplink=1), "server.shared_uplink"),
    (lambda: S.Workload([S.Stage(1, INF, 1, 1)], 2), "workload.stages[0].bwd_s"),
    (lambda: S.Workload([S.Stage(1, 1, 1, 1)], 2.0), "workload.micro_batches"),
    (lambda: S.Policy("sync", copy_efficiency=0), "policy.copy_efficiency"),
    (lambda: S.simulate(server(2), uniform(2, 2), "sync", chunk_bytes=INF), "chunk_bytes"),
    (lambda: S.workload_from_model("llama2-7b", 4, 8, tflops=INF), "tflops"),
    (lambda: S.workload_from_model("llama2-7b", 4, 8, seq_len=2048.0), "seq_len"),
]


@pytest.mark.parametrize("make,key", BAD, ids=[k for _, k in BAD])
def test_bad_input_names_the_key(make, key):
    with pytest.raises(QftError) as e:
        make()
    assert e.value.key == key


def cli(*args):
    return subprocess.run([sys.executable, "-m", "qft.tools.simulate", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_cli_prints_the_four_policies_and_writes_outputs(tmp_path):
    r = cli("rtx3090x4", "--micro-batches", "8", "--seq-len", "2048", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("| ")]
    assert [l.split("|")[1].strip() for l in lines[1:]] == list(S.POLICIES)
    for name in ("table.md", "table.csv", "step_time.png", "peak_memory.png", "gantt.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_cli_reads_a_yaml_server_and_workload(tmp_path):
    y = tmp_path / "srv.yaml"
    y.write_text("server: {n_gpus: 2, gpu_memory_bytes: 24e9, pcie_bandwidth: 25e9, nvlink_pairs: [[0, 1]], "
                 "nvlink_bandwidth: 56e9}\nworkload: {micro_batches: 4, stages: [{fwd_s: 0.1, bwd_s: 0.2, "
                 "act_bytes: 2e9, fixed_bytes: 1e9}, {fwd_s: 0.1, bwd_s: 0.2, act_bytes: 2e9, fixed_bytes: 1e9}]}\n")
    r = cli(str(y), "--offload-stages", "0")
    assert r.returncode == 0, r.stderr
    assert "| neighbour |" in r.stdout
    # the numbers are the YAML's: 2 GPUs of 24e9 B (22 GiB); 1F1B, 2 stages, 4 micro-batches of 0.1 + 0.2 s:
    # no offload takes (4 + 2 - 1) x 0.3 = 1.5 s a step
    assert r.stdout.startswith("custom (2 GPUs, 22 GiB, PCIe 25 GB/s, NVLink 56 GB/s pairs [[0, 1]])")
    assert "| none | 1.5 |" in r.stdout
    y.write_text(y.read_text().replace("fwd_s: 0.1", "fwd_s: 0.3"))
    slower = cli(str(y), "--offload-stages", "0")
    assert "| none | 2.5 |" in slower.stdout  # (4 + 1) x (0.3 + 0.2)


@pytest.mark.parametrize("args,key", [
    (["--micro-batches", "0"], "workload.micro_batches"),
    (["--fraction", "2"], "policy.fraction"),
    (["--placement", "ring"], "--placement"),
    (["/nonexistent/server.yaml"], "server"),
    (["rtx3090x4", "--stages", "5"], "workload.stages"),
])
def test_cli_bad_input_is_one_line_and_status_2(args, key):
    r = cli(*args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"qft: error: {key}=")


def test_cli_bad_flag_is_one_line_and_status_2():
    r = cli("--stages", "two")
    assert r.returncode == 2
    assert r.stderr == "qft: error: argument --stages: invalid int value: 'two'\n"


def test_cli_bad_yaml_key(tmp_path):
    y = tmp_path / "srv.yaml"
    y.write_text("n_gpus: 2\ngpu_memory_bytes: 24e9\npcie_bandwith: 25e9\n")
    r = cli(str(y))
    assert r.returncode == 2 and r.stderr.startswith("qft: error: server.pcie_bandwith=")
