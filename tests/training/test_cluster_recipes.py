"""The cluster recipes in examples/: a two-node rendezvous simulated on one host, the SLURM script run with
fake `srun` and `scontrol`, and the Kubeflow PyTorchJob checked against the training operator's model."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from gptlab.checkpoint import LAST, load_checkpoint

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SBATCH = EXAMPLES / "slurm" / "train.sbatch"
PYTORCHJOB = EXAMPLES / "kubernetes" / "pytorchjob.yaml"

STEPS = 6
# The tiny preset, shortened; float32 so that no precision probe can decide differently between runs.
SETTINGS = ["--max-steps", str(STEPS), "--eval-interval", "3", "--eval-batches", "2", "--batch-size", "8",
            "--device", "cpu", "--precision", "float32", "--samples", "0", "--no-progress"]
# Two nodes of one process each split every batch in halves and all-reduce the gradients: the same
# run as one process with the whole batch, up to the summation order (measured: at most 7e-7 apart
# after 6 steps; gradients left unaveraged would differ by about the learning rate, 3e-4 and up).
TOLERANCE = 1e-5

FAKE_SCONTROL = "#!/bin/bash\necho localhost\n"
# Runs its command once per "node", all at once, as srun does with --ntasks-per-node=1; fails if any fails.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    """The test's environment with the venv's launchers first on PATH and one thread per process."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", **extra}


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    checkpoint = load_checkpoint(run, prefer=LAST)
    assert checkpoint.state["step"] == STEPS
    return checkpoint.model_state


def assert_same_weights(a: Path, b: Path) -> None:
    weights_a, weights_b = final_weights(a), final_weights(b)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert_close(weights_a[name], weights_b[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def data_dir(char_corpus: Callable[[str], Path]) -> Path:
    return char_corpus("".join("the cat sat on the mat. " if i % 3 else "a dog ran in the park! "
                               for i in range(3000)))


@pytest.fixture(scope="module")
def one_process(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same settings trained by one plain process with the whole batch."""
    out = tmp_path_factory.mktemp("one") / "run"
    command = [sys.executable, "-m", "gptlab", "train", "--preset", "tiny", "--data", str(data_dir),
               "--out", str(out), *SETTINGS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment())
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_nodes_meet_at_a_c10d_rendezvous_and_train_one_run(data_dir: Path, one_process: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "nodes"]
    command = [*launcher, "-m", "gptlab", "train", "--preset", "tiny", "--data", str(data_dir),
               "--out", str(out), *SETTINGS]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=environment()) for _ in range(2)]
    results = [(node.wait(timeout=120), *node.communicate()) for node in nodes]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    said = "".join(out_text for _, out_text, _ in results)
    assert "2 process(es)" in said and said.count(f"finished at step {STEPS}") == 1  # only rank 0 speaks
    assert_same_weights(one_process, out)


def test_the_sbatch_script_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True).returncode == 0


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_fake_nodes(data_dir: Path, one_process: Path,
                                                    tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "run"
    env = environment(
        PATH=f"{bin_dir}{os.pathsep}{environment()['PATH']}",
        SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[01-02]", GPUS_PER_NODE="1",
        GPTLAB_PRESET="tiny", GPTLAB_DATA=str(data_dir), GPTLAB_OUT=str(out), GPTLAB_PORT=str(free_port()),
        GPTLAB_ARGS=shlex.join(SETTINGS),
    )
    result = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"2 node(s) x 1 process(es), rendezvous at localhost:{env['GPTLAB_PORT']}" in result.stdout
    assert "2 process(es)" in result.stdout and result.stdout.count(f"finished at step {STEPS}") == 1
    assert_same_weights(one_process, out)


def test_the_pytorchjob_is_a_valid_kubeflow_pytorchjob() -> None:
    yaml = pytest.importorskip("yaml")
    training = pytest.importorskip("kubeflow.training")
    from kubeflow.training.utils.utils import FakeResponse

    manifest = yaml.safe_load(PYTORCHJOB.read_text())
    client = training.ApiClient()
    # The SDK's own way to read a job from the cluster (TrainingClient.get_job) ...
    job = client.deserialize(FakeResponse(manifest), "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, training.KubeflowOrgV1PyTorchJob)
    # ... silently drops fields it does not know: written back, a misspelt or misplaced one would be missing.
    assert client.sanitize_for_serialization(job) == manifest
    assert (job.api_version, job.kind) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job.spec.pytorch_replica_specs
    assert sorted(replicas) == ["Master", "Worker"] and replicas["Master"].replicas == 1
    for spec in replicas.values():
        assert spec.restart_policy == "OnFailure"
        (container,) = spec.template.spec.containers
        assert container.name == "pytorch"  # the operator injects PET_* into the container of this name
        assert container.command == ["torchrun", "-m", "gptlab", "train"]
        assert not any(arg.startswith("--log") and arg != "--log-to" for arg in container.args)
        assert container.resources.limits["nvidia.com/gpu"] == job.spec.nproc_per_node
        mounts = {mount.name: mount.mount_path for mount in container.volume_mounts}
        volumes = {volume.name: volume for volume in spec.template.spec.volumes}
        assert volumes["runs"].persistent_volume_claim.claim_name == "gptlab-runs"
        out = container.args[container.args.index("--out") + 1]
        assert out.startswith(mounts["runs"] + "/")  # the run folder is on the shared volume
