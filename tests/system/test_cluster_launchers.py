"""The cluster launchers in tools/cluster/.

SLURM: tools/cluster/train.sbatch runs for real through tools/cluster/fake_srun.py (a stand-in for
sbatch/srun/scontrol that starts 2 "nodes" on this machine with SLURM's variables): the 2 nodes meet
at the c10d rendezvous on the first host of a compressed node list, train and evaluate together;
the time-limit signal makes every rank checkpoint and the job requeue itself.
Kubernetes: tools/cluster/pytorchjob.yaml is checked against the PyTorchJob schema of the Kubeflow
Training SDK (skipped when `kubeflow-training` is not installed) and against the operator's
admission rules, and its container command is run with the operator's variables set.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, subprocess_env

from maskrcnn_tut.lab.processes import free_port

CLUSTER = REPO / "tools" / "cluster"
SBATCH = CLUSTER / "train.sbatch"
FAKE = CLUSTER / "fake_srun.py"
MANIFEST = CLUSTER / "pytorchjob.yaml"
EVAL_KEYS = {"bbox_AP", "bbox_AP50", "bbox_AP75", "segm_AP", "segm_AP50", "segm_AP75"}
sys.path.insert(0, str(CLUSTER))
from fake_srun import expand_hostlist  # noqa: E402


def _env(tmp_path: Path, **extra) -> dict:
    env = subprocess_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # torchrun, python3
    for name in [k for k in env if k.startswith(("SLURM_", "PET_"))]:  # a real job around the tests
        del env[name]
    env.update(RDZV_PORT=str(free_port()), MAX_RESTARTS="0", FAKE_SLURM_LOG=str(tmp_path / "slurm.log"), **extra)
    return env


def _sbatch_cmd(shapes: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(FAKE), "sbatch", "--nodes", "2", "--job-id", "4242", str(SBATCH),
            "--data-path", str(shapes), "--max-steps", str(steps), "--batch-size", "1", "--min-size", "64",
            "--max-size", "96", "--workers", "0", "--no-progress", "--print-freq", "1", "--output-dir", str(out),
            *extra]


def test_hostlist_fallback_expands_compressed_lists(tmp_path):
    """Without scontrol the script's own expansion serves; with one (the stand-in's) it is used."""
    hostlist = "node[01-03,10],gpu-a[8-9]-ib[1-2],login"
    expected = ["node01", "node02", "node03", "node10", "gpu-a8-ib1", "gpu-a8-ib2", "gpu-a9-ib1", "gpu-a9-ib2",
                "login"]
    assert expand_hostlist(hostlist) == expected
    bare_path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("scontrol", path=bare_path):
        pytest.skip("a real scontrol is on the system PATH: the fallback cannot be isolated")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").symlink_to(FAKE)
    for path, via in ((bare_path, "fallback"), (f"{bindir}{os.pathsep}{bare_path}", "scontrol")):
        out = subprocess.run(["bash", "-c", f'source "{SBATCH}"; expand_hostlist "$1"', "_", hostlist],
                             capture_output=True, text=True, timeout=30,
                             env={"PATH": path, "PYTHON": sys.executable, "HOME": str(tmp_path)})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == expected, via  # and sourcing ran no job


@pytest.mark.system
def test_sbatch_two_nodes_train_and_evaluate(small_shapes, tmp_path):
    out_dir = tmp_path / "run"
    env = _env(tmp_path)
    run = subprocess.run(_sbatch_cmd(small_shapes, out_dir, 2), capture_output=True, text=True, timeout=240,
                         env=env, cwd=REPO)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    # the head node is the first host of the compressed list 127.0.0.[1-2]; one torchrun per node
    assert f"rendezvous 127.0.0.1:{env['RDZV_PORT']}" in log
    assert "SLURM_NODEID 0" in log and "SLURM_NODEID 1" in log
    assert json.loads((out_dir / "config.json").read_text())["derived"]["world_size"] == 2
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and EVAL_KEYS <= set(summary)
    assert "training finished" in log and not (tmp_path / "slurm.log").exists()  # no requeue when done


def _wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the job ended before it was signalled"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.system
def test_sbatch_time_limit_signal_checkpoints_and_requeues(small_shapes, tmp_path):
    """`#SBATCH --signal=B:USR1@300`: USR1 to the batch shell -> SIGTERM to srun -> torchrun ->
    every rank saves after the same step; the job requeues itself. The output dir comes from the
    job id (no --output-dir), which a requeued job keeps, and train.py gets --resume auto: so the
    requeued run continues from this checkpoint (train.py's resume has its own tests)."""
    out_dir = tmp_path / "runs" / "maskrcnn-4242"
    env = _env(tmp_path, RUNS_DIR=str(tmp_path / "runs"))
    cmd = _sbatch_cmd(small_shapes, out_dir, 1000)
    cut = cmd.index("--output-dir")
    cmd[cut:cut + 2] = []
    cmd[cmd.index("sbatch") + 1:cmd.index("sbatch") + 1] = ["--job-name", "maskrcnn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        metrics = out_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 180, proc)
        proc.send_signal(signal.SIGUSR1)  # the stand-in passes it to the batch shell, as slurmd would
        log = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, log[-5000:]  # stopped, not done
    assert f"--resume auto: no checkpoint in {out_dir / 'checkpoints'}, starting fresh" in log, log[-5000:]
    assert "time limit near (USR1)" in log and "requeueing job 4242" in log, log[-5000:]
    assert (tmp_path / "slurm.log").read_text() == "requeue 4242\n"
    assert not (out_dir / "summary.json").exists()
    stopped = torch.load(out_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert 1 <= stopped["state"]["step"] < 1000 and len(stopped["rng"]) == 2


# ---------------------------------------------------------------- the Kubeflow PyTorchJob manifest

def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _pytorch_container(pod: dict) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "pytorch")


def test_pytorchjob_manifest_follows_the_operator_rules():
    """The Training Operator's admission rules (its validating webhook) and what the docs rely on."""
    job = _manifest()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    name = job["metadata"]["name"]
    assert len(name) <= 63 and name[0].isalpha() and all(c.islower() or c.isdigit() or c == "-" for c in name)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    assert "nProcPerNode" not in job["spec"].get("elasticPolicy", {})  # forbidden together with nprocPerNode
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in {"All", "Running", "None"}
    nproc = job["spec"]["nprocPerNode"]
    for rtype, spec in specs.items():
        assert spec["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}, rtype
        pod = spec["template"]
        container = _pytorch_container(pod)  # the operator injects its variables into this one
        assert "EDIT-ME" in container["image"], "the image placeholder is marked"
        assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"]
        limits = container["resources"]["limits"]
        assert str(limits["nvidia.com/gpu"]) == nproc, "one process per GPU"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert "persistentVolumeClaim" in volumes[mounts["/runs"]]
        assert container["command"] == ["bash", "-c"] and container["args"][0].startswith("exec torchrun")
        grace = {e["name"]: e.get("value") for e in container["env"]}["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
        assert pod["spec"]["terminationGracePeriodSeconds"] > int(grace)  # torchrun's grace fits the pod's


def test_pytorchjob_command_runs_train_py_with_the_operator_variables(tmp_path):
    """The container's command, run by bash with the variables the operator sets, starts torchrun
    with c10d on the Master pod, and train.py accepts its flags (--resume auto into the PVC)."""
    container = _pytorch_container(_manifest()["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "torchrun").write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    (bindir / "torchrun").chmod(0o755)
    env = {"PATH": f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "8",
           "PET_NODE_RANK": "1", "MASTER_ADDR": "maskrcnn-master-0", "MASTER_PORT": "23456",
           "JOB_NAME": "maskrcnn"}
    out = subprocess.run(container["command"] + container["args"], capture_output=True, text=True, timeout=30,
                         env=env)
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)
    script = argv.index("maskrcnn_tut/train.py")
    launcher, train_args = argv[:script], argv[script + 1:]
    assert {"--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=maskrcnn-master-0:23456",
            "--rdzv-id=maskrcnn", "--max-restarts=3"} <= set(launcher)
    assert not any(arg.startswith("--shutdown") for arg in launcher)  # a flag torchrun < 2.12 rejects
    from maskrcnn_tut.flags import parse_args

    cfg, _ = parse_args(train_args)
    assert cfg.resume == "auto" and cfg.output_dir == "/runs/maskrcnn" and cfg.data_path == "/data/coco"


def _schema_diff(given, parsed, path="") -> list[str]:
    """Fields of the manifest that the schema's objects dropped (unknown or misspelled) or changed."""
    if isinstance(given, dict):
        if not isinstance(parsed, dict):
            return [f"{path}: not an object in the schema"]
        errors = []
        for key, value in given.items():
            if key not in parsed:
                errors.append(f"{path}/{key}: not in the schema")
            else:
                errors += _schema_diff(value, parsed[key], f"{path}/{key}")
        return errors
    if isinstance(given, list):
        if not isinstance(parsed, list) or len(given) != len(parsed):
            return [f"{path}: not a list in the schema"]
        return [err for i, (a, b) in enumerate(zip(given, parsed)) for err in _schema_diff(a, b, f"{path}[{i}]")]
    return [] if str(given) == str(parsed) else [f"{path}: {given!r} read as {parsed!r}"]


def _validate_with_sdk(doc: dict) -> list[str]:
    """Deserialize into the SDK's KubeflowOrgV1PyTorchJob (typed fields, required fields raise) and
    serialize back: anything the schema does not know is dropped, so it shows in the difference."""
    from kubeflow.training import ApiClient

    class Response:
        data = json.dumps(doc)

    client = ApiClient()
    job = client.deserialize(Response, "KubeflowOrgV1PyTorchJob")
    return _schema_diff(doc, client.sanitize_for_serialization(job))


def test_pytorchjob_manifest_matches_the_kubeflow_schema():
    pytest.importorskip("kubeflow.training", reason="the PyTorchJob schema check needs `pip install "
                                                    "kubeflow-training` (its models are the kubeflow.org/v1 schema)")
    doc = _manifest()
    assert _validate_with_sdk(doc) == []
    # the check is not vacuous: a misspelled field, a wrong type and a missing required field fail
    bad = json.loads(json.dumps(doc))
    bad["spec"]["nprocPerNodes"] = bad["spec"].pop("nprocPerNode")
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert sorted(_validate_with_sdk(bad)) == [
        "/spec/nprocPerNodes: not in the schema",
        "/spec/pytorchReplicaSpecs/Worker/template/spec/containers[0]/volumeMount: not in the schema"]
    bad = json.loads(json.dumps(doc))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(ValueError):
        _validate_with_sdk(bad)
    bad = json.loads(json.dumps(doc))
    del bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        _validate_with_sdk(bad)
