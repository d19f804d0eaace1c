"""A run stopped and resumed on a real two-node Ray cluster with token authentication.

Two ``ray start --block`` processes on this machine (a head and a worker node, 1 CPU each, each with
its own temp dir and working directory, both stopped by pid) form the cluster; a separate driver
process joins it through ``RAY_ADDRESS``, as the README's cluster recipe does, runs an uninterrupted
experiment, one stopped after round 2 and its resume, and reports what it saw as JSON. The test's own
Ray (the session's ``ray_session`` fixture) is never touched.

Token authentication is set up the way a user must do it on separate machines: one shared token,
``RAY_AUTH_MODE=token`` on every node and on the driver (``ray start --address`` and
``ray.init(address=...)`` never switch it on by themselves), the token given by file
(``RAY_AUTH_TOKEN_PATH``, head and driver) or by value (``RAY_AUTH_TOKEN``, worker node). The user's
own ``~/.ray/auth_token`` is neither read nor written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from conftest import tiny_overrides
from mlflow.tracking import MlflowClient

RAY_CLI = Path(sys.executable).with_name("ray")
START_TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(not RAY_CLI.exists(), reason="the ray CLI is not installed beside python")

# The driver: joins the cluster with fedray's own ensure_ray (RAY_ADDRESS), waits for the worker node,
# then runs full / stopped / resumed, noting after each run the ClientActors it started and their nodes.
DRIVER = r"""
import json, os, sys, time

import ray
from mlflow.tracking import MlflowClient
from ray.util.state import list_actors

from fedray.platform.config import load_config
from fedray.platform.run import ensure_ray, resume_experiment, run_experiment

overrides, out_path = json.loads(sys.argv[1]), sys.argv[2]
t0 = time.time(); print("imported", t0, flush=True)
ensure_ray(load_config(None, overrides))  # what run_experiment does first: join RAY_ADDRESS
deadline = time.monotonic() + 60
while sum(node["Alive"] for node in ray.nodes()) < 2:
    if time.monotonic() > deadline:
        sys.exit("the worker node never joined the cluster")
    time.sleep(0.2)


def actors():
    # the state API goes through the head's dashboard, with this process's token
    return {a.actor_id: (a.class_name, a.node_id) for a in list_actors(address=os.environ["RAY_ADDRESS"], limit=1000)}


def record(result, before):
    print(result.run_id, time.time() - t0, result.wall_time_s, flush=True)
    new = [v for k, v in actors().items() if k not in before]
    return {
        "run_id": result.run_id,
        "finished": result.finished,
        "history": result.history,
        "client_acc": {str(k): v for k, v in result.client_acc.items()},
        "client_actor_nodes": sorted(node for cls, node in new if cls == "ClientActor"),
        "coordinator_nodes": sorted(node for cls, node in new if cls == "Coordinator"),
    }


print("joined", time.time() - t0, flush=True)
out = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
before = actors()
out["full"] = record(run_experiment(load_config(None, overrides)), before)
before = actors()
out["stopped"] = record(run_experiment(load_config(None, overrides), stop_after_round=2), before)
out["stopped_status"] = MlflowClient().get_run(out["stopped"]["run_id"]).info.status
before = actors()
out["resumed"] = record(resume_experiment(out["stopped"]["run_id"]), before)
with open(out_path, "w") as f:
    json.dump(out, f)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def without_timing(history):
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


@contextmanager
def ray_node(args: list[str], env: dict[str, str], cwd: Path, log: Path):
    """``ray start --block ...``: yields once the node is up; SIGTERM to its pid stops all its processes."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(RAY_CLI), "start", "--block", "--disable-usage-stats", *args],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a last-resort kill reaches only this node
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"Ray runtime started" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start {' '.join(args)} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` then stops the processes it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def node_env(**auth: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", **auth)
    return env


def http_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_stopped_run_resumes_on_a_two_node_cluster_with_token_auth(mlflow_store, tmp_path):
    import ray  # only for the address every node and the driver use

    token = secrets.token_hex(32)  # what `ray get-auth-token --generate` writes
    token_file = tmp_path / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    ip = ray.util.get_node_ip_address()  # Ray turns 127.0.0.1 into this anyway
    port, dashboard_port, client_port = free_port(), free_port(), free_port()
    address = f"{ip}:{port}"
    dirs = {name: tmp_path / name for name in ("head-cwd", "worker-cwd", "driver-cwd", "storage")}
    for d in dirs.values():
        d.mkdir()
    overrides = tiny_overrides(
        rounds=4,
        checkpoint_every=2,
        storage_path="../storage",  # relative to the driver's cwd: the driver resolves it before it travels
        **{"train.fraction": 0.5, "train.local_epochs": 1},
    )
    overrides = [o for o in overrides if not o.startswith("ray.max_actors=")]  # sized by the cluster's CPUs
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "driver.json"

    print("start", time.time())
    with ExitStack() as stack:
        # socket paths must stay under 107 characters: a short temp dir per node, not tmp_path
        temp = [stack.enter_context(tempfile.TemporaryDirectory(prefix="fr-", dir="/tmp")) for _ in range(2)]
        stack.enter_context(
            ray_node(
                [
                    "--head",
                    f"--node-ip-address={ip}",
                    f"--port={port}",
                    f"--dashboard-port={dashboard_port}",
                    f"--ray-client-server-port={client_port}",
                    "--include-dashboard=true",
                    "--num-cpus=1",
                    "--object-store-memory=150000000",
                    f"--temp-dir={temp[0]}",
                ],
                node_env(RAY_AUTH_TOKEN_PATH=str(token_file)),
                dirs["head-cwd"],
                tmp_path / "head.log",
            )
        )
        # the driver imports torch and Lightning while the worker node starts; it waits for the node
        driver_env = node_env(RAY_AUTH_TOKEN_PATH=str(token_file), RAY_ADDRESS=address)
        driver = subprocess.Popen(
            [sys.executable, str(script), json.dumps(overrides), str(out)],
            env=driver_env,
            cwd=dirs["driver-cwd"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        stack.enter_context(
            ray_node(
                [
                    f"--address={address}",
                    f"--node-ip-address={ip}",
                    "--num-cpus=1",
                    "--object-store-memory=150000000",
                    f"--temp-dir={temp[1]}",
                ],
                node_env(RAY_AUTH_TOKEN=token),
                dirs["worker-cwd"],
                tmp_path / "worker.log",
            )
        )
        stack.callback(stop, driver)  # on a failure below, before the nodes go
        # the cluster enforces the token: the head's HTTP API refuses a request without it
        api = f"http://127.0.0.1:{dashboard_port}/api/v0/actors"  # the dashboard listens on localhost
        assert http_status(api) == 401
        assert http_status(api, "not-the-token") == 403
        assert http_status(api, token) == 200

        log, _ = driver.communicate(timeout=240)
        print(time.time(), log.decode()[-3000:])
        assert driver.returncode == 0, log.decode(errors="replace")[-5000:]

    print("end", time.time())
    report = json.loads(out.read_text())
    full, stopped, resumed = report["full"], report["stopped"], report["resumed"]

    # the run stopped after round 2 and was left KILLED; resumed, it finished under the same run id
    assert not stopped["finished"] and len(stopped["history"]) == 2
    assert report["stopped_status"] == "KILLED"
    assert resumed["run_id"] == stopped["run_id"] and resumed["finished"]
    client = MlflowClient(mlflow_store)
    assert client.get_run(resumed["run_id"]).info.status == "FINISHED"

    # ... to the numbers of the uninterrupted run on the same cluster, in its Result and in MLflow
    assert full["finished"] and len(full["history"]) == len(resumed["history"]) == 4
    assert without_timing(resumed["history"]) == without_timing(full["history"])
    assert resumed["client_acc"] == full["client_acc"]
    for key in without_timing(full["history"])[-1]:
        logged = {
            run: sorted((m.step, m.value) for m in client.get_metric_history(run, key))
            for run in (full["run_id"], resumed["run_id"])
        }
        assert logged[resumed["run_id"]] == logged[full["run_id"]], key
        assert [step for step, _ in logged[full["run_id"]]] == [
            i + 1 for i, h in enumerate(full["history"]) if key in h
        ], key

    # every run's ClientActors (one per CPU: two) ran on both nodes, its Coordinator on one of them
    assert len(report["nodes"]) == 2
    for run in (full, stopped, resumed):
        assert len(run["client_actor_nodes"]) == 2 and set(run["client_actor_nodes"]) == set(report["nodes"])
        assert len(run["coordinator_nodes"]) == 1 and run["coordinator_nodes"][0] in report["nodes"]

    # the checkpoints are under the storage path, resolved against the driver's cwd, and nowhere else
    storage = dirs["storage"].resolve()
    ckpt = Path(client.get_run(resumed["run_id"]).data.tags["fedray.checkpoint_dir"])
    assert ckpt.parent == storage
    assert {p.name for p in ckpt.iterdir()} == {"config.yaml", "checkpoint.pt", "states"}
    import torch

    state = torch.load(ckpt / "checkpoint.pt", weights_only=False)
    assert state["round"] == 4 and without_timing(state["history"]) == without_timing(full["history"])
    assert sorted(p.name for p in (ckpt / "states").iterdir()) == sorted(state["states"].values())
    full_ckpt = Path(client.get_run(full["run_id"]).data.tags["fedray.checkpoint_dir"])
    assert sorted(storage.iterdir()) == sorted([ckpt, full_ckpt])
    for name in ("head-cwd", "worker-cwd", "driver-cwd"):
        assert not any(dirs[name].iterdir()), f"{name} holds {sorted(os.listdir(dirs[name]))}"
