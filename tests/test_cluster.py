"""A run stopped and resumed, and a run that loses a node, on a real two-node Ray cluster with token
authentication.

Two ``ray start --block`` processes on this machine (a head and a worker node, 1 CPU each, each with
its own temp dir and working directory, both stopped by pid) form the cluster; a separate driver
process joins it through ``RAY_ADDRESS``, as the README's cluster recipe does, runs an uninterrupted
experiment, one stopped after round 2 and its resume, and reports what it saw as JSON. Its runs share
their processes (``sharing_processes``, as ``fedray compare`` does): the first run's Coordinator and
ClientActors, kept on both nodes, serve every later run. The test's own
Ray (the session's ``ray_session`` fixture) is never touched. This is the suite's test that a resumed
run ends with the numbers of an uninterrupted one (``test_run_signals`` resumes after a SIGTERM).

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
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
from conftest import free_port, tiny_overrides, without_timing
from mlflow.tracking import MlflowClient

from fedray.platform.tracking.names import Metrics, Tags

RAY_CLI = Path(sys.executable).with_name("ray")
START_TIMEOUT_S = 180  # generous: a loaded machine must not fail the test

pytestmark = pytest.mark.skipif(not RAY_CLI.exists(), reason="the ray CLI is not installed beside python")

# The driver: joins the cluster with fedray's own ensure_ray (RAY_ADDRESS), waits for the worker node,
# then runs full / stopped / resumed, noting after each run the ClientActors it started and their nodes.
DRIVER = r"""
import json, os, sys, threading, time
from pathlib import Path

start = time.monotonic()


def note(what):  # phase times in driver.log, shown when the driver fails
    print(f"{time.monotonic() - start:6.1f} s  {what}", flush=True)


import ray
from mlflow.tracking import MlflowClient
from ray.util.state import list_actors

from fedray.platform.catalog import load_config
from fedray.platform.runtime.driver import ensure_ray, resume_experiment, run_experiment
from fedray.platform.runtime.processes import sharing_processes

overrides, out_path, head_up = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
note("imported")
MlflowClient().search_experiments()  # creates the sqlite store (seconds) while the nodes start
while not os.path.exists(head_up):  # the head is up once this file exists
    time.sleep(0.1)
ensure_ray(load_config(None, overrides))  # what run_experiment does first: join RAY_ADDRESS
deadline = time.monotonic() + 180
while sum(node["Alive"] for node in ray.nodes()) < 2:
    if time.monotonic() > deadline:
        sys.exit("the worker node never joined the cluster")
    time.sleep(0.2)
note("joined, both nodes up")


def all_cpus_free():
    # run_experiment sizes its pool by ray.available_resources(): wait until they show both nodes'
    # CPUs (the worker node's appear a moment after it joins), or it starts a single ClientActor
    deadline = time.monotonic() + 120
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)


def actors():
    # the state API goes through the head's dashboard, with this process's token
    return {a.actor_id: (a.class_name, a.node_id) for a in list_actors(address=os.environ["RAY_ADDRESS"], limit=1000)}


def record(result, before):
    note(f"run {result.run_id} done: {len(result.history)} rounds")
    new = [v for k, v in actors().items() if k not in before]
    return {
        "run_id": result.run_id,
        "finished": result.finished,
        "history": result.history,
        "client_acc": {str(k): v for k, v in result.client_acc.items()},
        "client_actor_nodes": sorted(node or "not placed" for cls, node in new if cls == "ClientActor"),
        "coordinator_nodes": sorted(node or "not placed" for cls, node in new if cls == "Coordinator"),
        "driver_node": ray.get_runtime_context().get_node_id(),
    }


import psutil

out = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
me = ray.get_runtime_context().get_node_id()
other = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != me][0]
out["driver_on_head"] = any("node:__internal_head__" in n["Resources"] for n in ray.nodes() if n["NodeID"] == me)


def lose_the_other_node_after_round_2(storage, earlier):
    # on the Coordinator's progress, not on the driver's rounds (it logs them behind the Coordinator,
    # far behind on a loaded machine): the versions the clients committed to the new run's folder,
    # two a round (train.fraction 0.5 of 4 clients)
    while True:
        versions = {}
        for run_dir in set(storage.iterdir()) - earlier:
            for state in (run_dir / "states").glob("*-v*.pt"):
                client, version = state.stem.split("-v")
                versions[client] = max(versions.get(client, 0), int(version))
        if sum(versions.values()) >= 4:
            break
        time.sleep(0.02)
    for proc in psutil.process_iter(["name", "cmdline"]):
        if f"--node_id={other}" in (proc.info["cmdline"] or []) and "raylet" in (proc.info["name"] or ""):
            doomed = [proc, *proc.children(recursive=True)]  # the raylet and the node's workers
            for p in doomed:
                p.kill()
            note(f"killed node {other}: raylet pid {proc.pid} and {len(doomed) - 1} processes")
            out["killed_node"] = True


with sharing_processes():  # every run below starts on the last one's processes
    all_cpus_free()
    before = actors()
    out["full"] = record(run_experiment(load_config(None, overrides)), before)
    before = actors()
    out["stopped"] = record(run_experiment(load_config(None, overrides), stop_after_round=2), before)
    out["stopped_status"] = MlflowClient().get_run(out["stopped"]["run_id"]).info.status
    before = actors()
    out["resumed"] = record(resume_experiment(out["stopped"]["run_id"]), before)

    # the worker node lost mid-run: its raylet (with its object store) and its processes killed once
    # round 2's states are committed, as round 3 starts; rounds 1-2 committed client states on both
    # nodes. Six rounds of 40 local epochs (a second or two each), against an undisturbed run of the
    # same config
    longer = [*overrides, "rounds=6", "train.local_epochs=40"]
    before = actors()
    out["full10"] = record(run_experiment(load_config(None, longer)), before)
    before = actors()
    storage = Path("../storage").resolve()
    killer = threading.Thread(target=lose_the_other_node_after_round_2, args=(storage, set(storage.iterdir())))
    killer.start()
    out["node_lost"] = record(run_experiment(load_config(None, longer)), before)
    killer.join(timeout=60)
with open(out_path, "w") as f:
    json.dump(out, f)
"""


def start_node(stack: ExitStack, args: list[str], env: dict[str, str], cwd: Path, log: Path):
    """``ray start --block ...`` in the background, stopped when ``stack`` closes: SIGTERM to its pid
    makes it stop every process it started."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # no log monitor (nor, on the head, autoscaler monitor): nothing here reads them
            [str(RAY_CLI), "start", "--block", "--disable-usage-stats", "--include-log-monitor=false", *args],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a last-resort kill reaches only this node
        )

    def stop_node():
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    stack.callback(stop_node)
    return proc


def wait_until_up(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while b"Ray runtime started" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{' '.join(proc.args)} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def node_env(**auth: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_worker_niceness="0", **auth)
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
        # clients that keep state (their own extractors), so committed states cross nodes and resume
        algorithm="lgfedavg",
        rounds=4,
        checkpoint_every=2,
        storage_path="../storage",  # relative to the driver's cwd: the driver resolves it before it travels
        **{"train.fraction": 0.5, "train.local_epochs": 1},
    )
    overrides = [o for o in overrides if not o.startswith("ray.max_actors=")]  # sized by the cluster's CPUs
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out, head_up = tmp_path / "driver.json", tmp_path / "head-up"

    with ExitStack() as stack:
        # socket paths must stay under 107 characters: a short temp dir per node, not tmp_path
        temp = [stack.enter_context(tempfile.TemporaryDirectory(prefix="fr-", dir="/tmp")) for _ in range(2)]
        # the driver imports torch and Lightning while the nodes start, then waits for the head (a file
        # this test writes), joins and waits for the worker node. The worker node starts once the head
        # is fully up: joining while the head still started its dashboard timed out once on a loaded
        # machine (its GCS was too slow to answer)
        head_log, worker_log, driver_log = (tmp_path / f"{n}.log" for n in ("head", "worker", "driver"))
        head = start_node(
            stack,
            [
                "--head",
                f"--node-ip-address={ip}",
                f"--port={port}",
                f"--dashboard-port={dashboard_port}",
                f"--ray-client-server-port={client_port}",
                "--no-monitor",
                "--include-dashboard=true",  # the state API (where the actors ran) goes through it
                "--num-cpus=1",
                "--object-store-memory=150000000",
                f"--temp-dir={temp[0]}",
            ],
            node_env(RAY_AUTH_TOKEN_PATH=str(token_file)),
            dirs["head-cwd"],
            head_log,
        )
        with open(driver_log, "wb") as log:
            driver = subprocess.Popen(  # MLFLOW_TRACKING_URI: the mlflow_store fixture's, from os.environ
                [sys.executable, str(script), json.dumps(overrides), str(out), str(head_up)],
                env=node_env(RAY_AUTH_TOKEN_PATH=str(token_file), RAY_ADDRESS=address),
                cwd=dirs["driver-cwd"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        stack.callback(stop, driver)  # on a failure, before the head goes
        wait_until_up(head, head_log)
        head_up.touch()
        worker = start_node(
            stack,
            [
                f"--address={address}",
                f"--node-ip-address={ip}",
                "--num-cpus=1",
                "--object-store-memory=150000000",
                f"--temp-dir={temp[1]}",
            ],
            # Ray gives a joining node about 20 tries to reach the head's GCS; this is its setting for
            # a longer budget (seconds), for a loaded machine
            node_env(RAY_AUTH_TOKEN=token, RAY_gcs_server_port_wait_time_s=str(START_TIMEOUT_S)),
            dirs["worker-cwd"],
            worker_log,
        )
        wait_until_up(worker, worker_log)

        # the cluster enforces the token: the head's HTTP API refuses a request without it
        api = f"http://127.0.0.1:{dashboard_port}/api/v0/actors"  # the dashboard listens on localhost
        assert http_status(api) == 401
        assert http_status(api, "not-the-token") == 403
        assert http_status(api, token) == 200

        driver.wait(timeout=900)  # generous: a loaded machine must not fail the test
        assert driver.returncode == 0, driver_log.read_text()[-5000:]
        for node in (worker, head):
            node.send_signal(signal.SIGTERM)  # the nodes stop (seconds) while the results are checked
        check(json.loads(out.read_text()), mlflow_store, dirs)


def check(report: dict, mlflow_store: str, dirs: dict[str, Path]) -> None:
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

    # the first run's ClientActors (one per CPU: two) ran on both nodes, its Coordinator on the
    # driver's; the runs after it started no process: they ran on those, kept between runs
    assert len(report["nodes"]) == 2
    assert len(full["client_actor_nodes"]) == 2 and set(full["client_actor_nodes"]) == set(report["nodes"])
    assert full["coordinator_nodes"] == [full["driver_node"]]  # the Coordinator runs beside the driver
    for run in (stopped, resumed, report["full10"]):
        assert run["client_actor_nodes"] == [] and run["coordinator_nodes"] == []

    # the node lost in round 3 took a worker and the states it had committed in its object store;
    # the run went on with the other node's worker, from the copies held beside the Coordinator, to
    # the uninterrupted run's numbers (re-run clients counted)
    lost, reference = report["node_lost"], report["full10"]
    assert report["driver_on_head"] and report["killed_node"]
    assert lost["finished"] and len(lost["history"]) == 6
    assert sum(h[Metrics.CLIENTS_RETRIED] for h in lost["history"]) >= 1  # the lost node's calls ran again
    assert lost["client_actor_nodes"] == ["not placed"]  # its replacement waited for a node with room
    assert lost["coordinator_nodes"] == []  # not restarted: it held the states
    assert all(h[Metrics.CLIENTS_FAILED] == 0 for h in lost["history"])
    uncounted = [
        {k: v for k, v in h.items() if k != Metrics.CLIENTS_RETRIED} for h in without_timing(lost["history"])
    ]
    assert uncounted == [
        {k: v for k, v in h.items() if k != Metrics.CLIENTS_RETRIED}
        for h in without_timing(reference["history"])
    ]
    assert lost["client_acc"] == reference["client_acc"]

    # the checkpoints are under the storage path, resolved against the driver's cwd, and nowhere else
    storage = dirs["storage"].resolve()
    ckpt = Path(client.get_run(resumed["run_id"]).data.tags[Tags.CHECKPOINT_DIR])
    assert ckpt.parent == storage
    assert {p.name for p in ckpt.iterdir()} == {"config.yaml", "checkpoint.pt", "states", ".driver.lock"}
    import torch

    state = torch.load(ckpt / "checkpoint.pt", weights_only=False)
    assert state["round"] == 4 and without_timing(state["history"]) == without_timing(full["history"])
    assert sorted(p.name for p in (ckpt / "states").iterdir()) == sorted(state["states"].values())
    others = [
        Path(client.get_run(run["run_id"]).data.tags[Tags.CHECKPOINT_DIR]) for run in (full, reference, lost)
    ]
    assert sorted(storage.iterdir()) == sorted([ckpt, *others])
    for name in ("head-cwd", "worker-cwd", "driver-cwd"):
        assert not any(dirs[name].iterdir()), f"{name} holds {sorted(os.listdir(dirs[name]))}"
