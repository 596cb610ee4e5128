"""Private, throw-away ``redis-server`` processes for benchmarks and tests.

Contract:

- every server binds to loopback only (``127.0.0.1``), on a port that was free when it
  was picked (``loopback_ports.free_port``; for cluster nodes the bus port ``port + 10000`` too);
- persistence is off (``--save ""``, ``--appendonly no``) and each server runs in its own
  directory (``workdir``, also where ``redis.log`` and a cluster node's ``nodes.conf``
  go): the caller chooses it, ``RedisProcess`` creates it if needed, and the caller
  removes it when done (``kill`` leaves it, so a restart finds the same files);
- whoever calls ``start`` (or ``start_cluster``) owns the process(es) and kills them with
  ``kill`` (the context managers ``started`` / ``started_cluster`` do that on exit);
  ``start`` itself kills the server when it does not answer in time, and
  ``start_cluster`` kills every node it started when the cluster does not form;
- a server that does not start is a ``RuntimeError`` carrying the tail of its log; a
  missing ``redis-server`` / ``redis-cli`` is a ``RuntimeError`` too (callers that
  want to skip instead check ``find_redis_server`` / ``find_redis_cli`` first).

``redis`` (redis-py) is imported only where it is used, so importing this module stays
cheap for command-line parsers.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from hicache.bench.loopback_ports import free_port

if TYPE_CHECKING:
    import redis

LOG_NAME = "redis.log"
LOG_TAIL_CHARS = 2000
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on its port + 10000

CLUSTER_NODE_ARGS: tuple[str, ...] = (
    "--cluster-enabled", "yes",
    "--cluster-config-file", "nodes.conf",
    "--cluster-node-timeout", "2000",
    # An L3 cache keeps serving the slots it still has when one node is lost.
    "--cluster-require-full-coverage", "no",
)  # fmt: skip


def find_redis_server() -> str | None:
    """The ``redis-server`` executable on ``PATH``, or None."""
    return shutil.which("redis-server")


def find_redis_cli() -> str | None:
    """The ``redis-cli`` executable on ``PATH``, or None."""
    return shutil.which("redis-cli")


class RedisProcess:
    """One ``redis-server`` we started; ``kill`` / ``start`` keep the same port and directory."""

    def __init__(self, workdir: Path, port: int, extra: Sequence[str] | None = None) -> None:
        self.workdir = workdir
        self.port = port
        self.extra = list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def log_tail(self) -> str:
        """The last lines of the server's log ("" when it wrote none)."""
        try:
            return (self.workdir / LOG_NAME).read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers (as the process we started: ``INFO``'s
        ``process_id``); on failure kill it and raise."""
        import redis

        exe = find_redis_server()
        if exe is None:
            raise RuntimeError("redis-server not installed")
        args = [
            exe,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / LOG_NAME),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    # our process, not another server that took the port meanwhile
                    if client.info("server").get("process_id") == self.proc.pid:
                        return
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not start:\n{self.log_tail() or '(no log)'}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server if it runs and reap it (the directory stays)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        """A new redis-py client of this server; the caller closes it."""
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def keys(self) -> int:
        """How many keys the server holds now."""
        with self.client() as c:
            return int(c.dbsize())


@contextmanager
def started(workdir: Path, extra: Sequence[str] | None = None) -> Iterator[RedisProcess]:
    """A server on a free port in ``workdir``, started on entry and killed on exit."""
    server = RedisProcess(workdir, free_port(), extra)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def start_cluster(
    base_dir: Path, masters: int = 3, node_args: Sequence[str] = CLUSTER_NODE_ARGS, replicas: int = 0
) -> list[RedisProcess]:
    """Start ``masters * (1 + replicas)`` cluster-enabled servers in ``base_dir/node{i}``,
    join them into one cluster (``replicas`` replicas per master, placed by ``redis-cli``)
    and wait until every node reports ``cluster_state:ok`` and every replica is in sync.

    The caller kills the nodes returned; on failure this kills what it started and raises.
    """
    if find_redis_server() is None:
        raise RuntimeError("redis-server not installed")
    cli = find_redis_cli()
    if cli is None:
        raise RuntimeError("redis-cli not installed")
    nodes: list[RedisProcess] = []
    try:
        for i in range(masters * (1 + replicas)):
            node = RedisProcess(base_dir / f"node{i}", free_port(also=CLUSTER_BUS_OFFSET), node_args)
            node.start()
            nodes.append(node)
        created = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            out = (created.stdout + created.stderr).decode(errors="replace")[-LOG_TAIL_CHARS:]
            raise RuntimeError(f"redis-cli --cluster create failed ({created.returncode}):\n{out}")
        wait_cluster_ok(nodes, 30)
        if replicas:
            wait_replicas_in_sync(nodes, 30)
    except BaseException:
        for n in nodes:
            n.kill()
        raise
    return nodes


def wait_cluster_ok(nodes: Sequence[RedisProcess], timeout: float) -> None:
    """Wait until every node in ``nodes`` reports ``cluster_state:ok``; raise after ``timeout``."""
    import redis

    deadline = time.monotonic() + timeout
    while True:
        states: list[str | None] = []
        for n in nodes:
            try:
                with n.client() as c:
                    info = c.cluster("info")
            except redis.RedisError:
                info = None
            states.append(info.get("cluster_state") if isinstance(info, dict) else None)
        if all(s == "ok" for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis cluster did not become ready: {states}")
        time.sleep(0.05)


def wait_replicas_in_sync(nodes: Sequence[RedisProcess], timeout: float) -> None:
    """Wait until every replica among ``nodes`` reports its link to its master up; raise
    after ``timeout``."""
    import redis

    deadline = time.monotonic() + timeout
    while True:
        links: list[str | None] = []
        for n in nodes:
            try:
                with n.client() as c:
                    info = c.info("replication")
            except redis.RedisError:
                info = {}
            if info.get("role") == "slave":
                links.append(info.get("master_link_status"))
        if all(link == "up" for link in links):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis replicas did not sync: {links}")
        time.sleep(0.05)


@contextmanager
def started_cluster(base_dir: Path, masters: int = 3, replicas: int = 0) -> Iterator[list[RedisProcess]]:
    """``start_cluster`` on entry; every node killed on exit."""
    nodes = start_cluster(base_dir, masters, replicas=replicas)
    try:
        yield nodes
    finally:
        for n in nodes:
            n.kill()
