#!/usr/bin/env python3
"""A toy agentic-RL rollout against `dsec up`.

N tasks run in parallel, one sandbox each. Every task is a workspace layer
holding a small Python repo (/repo) with a bug and a unittest suite, both
generated here. A scripted "policy" (no model) works on it the way an agent
would: it opens a shell session, runs the tests (they fail), lists the repo,
reads the buggy module, patches it with a string rewrite, writes it back and
re-runs the tests. The exit code of `python3 -m unittest` is the reward.

    python3 examples/rollout/rollout.py --tasks 64 --concurrency 32

Needs a running `dsec up` (endpoint and key from DSEC_ENDPOINT / DSEC_API_KEY
or ~/.config/dsec/config.json) and the dsec CLI to build layers. The base
layer base/rollout-python:3.11 is built by make_base.sh when it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
try:
    import libdsec  # noqa: F401
except ImportError:  # run from a checkout without `pip install ./sdk/python`
    sys.path.insert(0, str(REPO_ROOT / "sdk" / "python" / "src"))
from libdsec import DSecClient, DSecContainerRunArgs, NodesUnreachable, NotFound  # noqa: E402

BASE_REF = "base/rollout-python:3.11"
TASK_TAG = "v1"


# --------------------------------------------------------------------------
# Task generation: task i is a one-function module with a bug that depends on
# i (four kinds of bug, constants varying with i) plus a unittest file.


@dataclass
class Task:
    index: int
    kind: str
    module: str  # file name under /repo
    source: str  # the buggy module
    tests: str  # test_<module>.py

    @property
    def ref(self) -> str:
        return f"workspace/rollout-task-{self.index}:{TASK_TAG}"


def make_task(i: int) -> Task:
    k = i // 4 + 1
    kind = ("off-by-one range", "sign", "off-by-one index", "boundary")[i % 4]
    if i % 4 == 0:
        mod = "triangle"
        src = f'def triangle(n):\n    """1 + 2 + ... + n."""\n    return sum(range(1, n))\n'
        n = k + 2
        cases = f"        self.assertEqual(triangle({n}), {n * (n + 1) // 2})\n"
        cases += "        self.assertEqual(triangle(1), 1)\n"
    elif i % 4 == 1:
        mod = "shift"
        src = f'def shift(x):\n    """x moved up by {k}."""\n    return x - {k}\n'
        cases = f"        self.assertEqual(shift(10), {10 + k})\n"
        cases += f"        self.assertEqual(shift(-{k}), 0)\n"
    elif i % 4 == 2:
        mod = "last"
        src = 'def last(xs):\n    """The last element of a non-empty list."""\n    return xs[len(xs)]\n'
        xs = list(range(k, 2 * k + 2))
        cases = f"        self.assertEqual(last({xs}), {xs[-1]})\n"
        cases += "        self.assertEqual(last(['only']), 'only')\n"
    else:
        mod = "at_least"
        lim = 10 + k
        src = f'def at_least(x):\n    """True when x is at least {lim}."""\n    return x > {lim}\n'
        cases = f"        self.assertTrue(at_least({lim}))\n"
        cases += f"        self.assertTrue(at_least({lim + 1}))\n"
        cases += f"        self.assertFalse(at_least({lim - 1}))\n"
    tests = (
        f"import unittest\n\nfrom {mod} import {mod}\n\n\n"
        f"class Test{mod.title().replace('_', '')}(unittest.TestCase):\n"
        f"    def test_task_{i}(self):\n{cases}\n\n"
        "if __name__ == '__main__':\n    unittest.main()\n"
    )
    return Task(i, kind, f"{mod}.py", src, tests)


def write_task_dir(task: Task, root: Path) -> Path:
    d = root / f"task-{task.index}"
    repo = d / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    (repo / task.module).write_text(task.source)
    (repo / f"test_{task.module}").write_text(task.tests)
    (repo / "README").write_text(f"rollout task {task.index}: make `python3 -m unittest` pass\n")
    return d


# --------------------------------------------------------------------------
# The "policy": a fixed list of rewrite rules; the first one that matches the
# module's source is the patch. A stand-in for a model's edit.

RULES = [
    (re.compile(r"range\(1, (\w+)\)"), r"range(1, \1 + 1)"),
    (re.compile(r"return (\w+) - (\d+)"), r"return \1 + \2"),
    (re.compile(r"\[len\((\w+)\)\]"), r"[len(\1) - 1]"),
    (re.compile(r"return (\w+) > (\d+)"), r"return \1 >= \2"),
]


def policy_patch(source: str) -> str:
    for pat, repl in RULES:
        new, n = pat.subn(repl, source, count=1)
        if n:
            return new
    return source


# --------------------------------------------------------------------------
# Layers


def layer_exists(dsec_bin: str, ref: str) -> bool:
    r = subprocess.run([dsec_bin, "layer", "get", ref], capture_output=True, text=True)
    return r.returncode == 0


def ensure_base(dsec_bin: str) -> None:
    if layer_exists(dsec_bin, BASE_REF):
        return
    print(f"building {BASE_REF} with make_base.sh ...", file=sys.stderr)
    subprocess.run(["sh", str(HERE / "make_base.sh"), dsec_bin], check=True, stdout=sys.stderr)


async def ensure_task_layers(client: DSecClient, dsec_bin: str, tasks: list[Task], rebuild: bool) -> int:
    """Build workspace/rollout-task-<i>:v1 for every task that lacks one.
    Returns how many were built."""
    missing = []
    for t in tasks:
        if rebuild:
            missing.append(t)
            continue
        try:
            await client.get_layer(t.ref)
        except NotFound:
            missing.append(t)
    if not missing:
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="dsec-rollout-"))
    sem = asyncio.Semaphore(4)

    async def build(t: Task) -> None:
        d = write_task_dir(t, tmp)
        name, tag = t.ref.split("/", 1)[1].split(":")
        async with sem:
            p = await asyncio.create_subprocess_exec(
                dsec_bin, "layer", "build", "--kind", "workspace", "--name", name, "--tag", tag, str(d),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"layer build {t.ref}: exit {p.returncode}: {out.decode(errors='replace')}")

    try:
        await asyncio.gather(*(build(t) for t in missing))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return len(missing)


# --------------------------------------------------------------------------
# One rollout


@dataclass
class Result:
    task: int
    kind: str
    reward: int = 0
    steps: int = 0
    create_s: float = 0.0
    wall_s: float = 0.0
    error: str = ""
    step_ms: list[float] = field(default_factory=list)


async def rollout(client: DSecClient, task: Task, job: str, sem: asyncio.Semaphore) -> Result:
    res = Result(task.index, task.kind)

    async def step(aw):
        t0 = time.perf_counter()
        out = await aw
        res.step_ms.append((time.perf_counter() - t0) * 1000)
        res.steps += 1
        return out

    args = DSecContainerRunArgs(
        container_image=BASE_REF,
        workspace=task.ref,
        memory_limit_mb=256,
        cpu_cores_limit=1,
        ttl_running_stop=300,
        labels={"job": job, "task": str(task.index)},
    )
    async with sem:
        t0 = time.perf_counter()
        try:
            async with client.run_container(args, timeout=120) as sb:
                res.create_s = time.perf_counter() - t0
                # No .pyc files: a patch that keeps the file's size within the same
                # second as the first test run would otherwise run the stale bytecode.
                async with sb.session(env={"PYTHONDONTWRITEBYTECODE": "1"}) as sh:
                    await step(sh.run("cd /repo"))
                    before = await step(sh.run("python3 -m unittest -q 2>&1", timeout=60))
                    if before.exit_code == 0:
                        raise RuntimeError("tests passed before the fix")
                    entries = await step(sb.list_dir("/repo"))
                    names = sorted(os.path.basename(e.path) for e in entries)
                    target = next(n for n in names if n.endswith(".py") and not n.startswith("test_"))
                    source = (await step(sb.read_file(f"/repo/{target}"))).decode()
                    patched = policy_patch(source)
                    await step(sb.write_file(f"/repo/{target}", patched))
                    after = await step(sh.run("python3 -m unittest -q 2>&1", timeout=60))
                    res.reward = 1 if after.exit_code == 0 else 0
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed rollout scores 0 and says why
            res.error = f"{type(e).__name__}: {e}"
        res.wall_s = time.perf_counter() - t0
    return res


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]


async def run(opts: argparse.Namespace, job: str) -> dict:
    client = DSecClient(max_connections=max(64, 2 * opts.concurrency))
    try:
        await client.open()
        tasks = [make_task(i) for i in range(opts.tasks)]
        t0 = time.perf_counter()
        built = await ensure_task_layers(client, opts.dsec_bin, tasks, opts.rebuild_layers)
        layers_s = time.perf_counter() - t0
        sem = asyncio.Semaphore(opts.concurrency)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(rollout(client, t, job, sem) for t in tasks))
        elapsed = time.perf_counter() - t0
    finally:
        try:
            await asyncio.shield(delete_job(client, job))
        finally:
            await client.close()
    steps = [ms for r in results for ms in r.step_ms]
    totals = {
        "tasks": len(results),
        "passed": sum(r.reward for r in results),
        "mean_reward": sum(r.reward for r in results) / max(1, len(results)),
        "steps": len(steps),
        "elapsed_s": elapsed,
        "sandboxes_per_s": len(results) / elapsed if elapsed else 0.0,
        "step_p50_ms": pct(steps, 50),
        "step_p99_ms": pct(steps, 99),
        "create_p50_s": pct([r.create_s for r in results], 50),
        "concurrency": opts.concurrency,
        "layers_built": built,
        "layers_s": layers_s,
    }
    return {"job": job, "results": [asdict(r) for r in results], "totals": totals}


def print_table(doc: dict) -> None:
    print(f"{'task':>4}  {'bug':<17} {'reward':>6} {'steps':>5} {'create_s':>8} {'wall_s':>7}  error")
    for r in doc["results"]:
        print(f"{r['task']:>4}  {r['kind']:<17} {r['reward']:>6} {r['steps']:>5} "
              f"{r['create_s']:>8.2f} {r['wall_s']:>7.2f}  {r['error']}")
    t = doc["totals"]
    print("-" * 60)
    print(f"reward: {t['passed']}/{t['tasks']} passed (mean {t['mean_reward']:.2f}), "
          f"{t['steps']} steps, concurrency {t['concurrency']}")
    print(f"wall: {t['elapsed_s']:.2f} s, {t['sandboxes_per_s']:.2f} sandboxes/s, "
          f"step latency p50 {t['step_p50_ms']:.1f} ms p99 {t['step_p99_ms']:.1f} ms, "
          f"create p50 {t['create_p50_s']:.2f} s")


async def delete_job(client: DSecClient, job: str) -> int:
    """Delete the job's sandboxes; a node that could not be asked is said,
    not raised (the run's results stand; its sandboxes end with their TTL)."""
    try:
        return await client.delete(labels={"job": job})
    except NodesUnreachable as e:
        print(f"cleanup: {e}", file=sys.stderr)
        return e.count


async def cleanup(job: str) -> None:
    # Twice: a create cut short by the interrupt may still finish on the server.
    async with DSecClient() as client:
        n = await delete_job(client, job)
        await asyncio.sleep(1)
        n += await delete_job(client, job)
        if n:
            print(f"cleanup: deleted {n} sandboxes labelled job={job}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=8, help="number of tasks (sandboxes), default 8")
    ap.add_argument("--concurrency", type=int, default=32, help="rollouts at once, default 32")
    ap.add_argument("--json", action="store_true", help="print results and totals as JSON")
    ap.add_argument("--dsec-bin", default=None, help="dsec CLI used to build layers (default: bin/dsec of this repo, else dsec)")
    ap.add_argument("--rebuild-layers", action="store_true", help="rebuild the task layers even if present")
    opts = ap.parse_args()
    if opts.dsec_bin is None:
        local = REPO_ROOT / "bin" / "dsec"
        opts.dsec_bin = str(local) if local.exists() else (shutil.which("dsec") or "dsec")
    job = f"rollout-{int(time.time())}"
    ensure_base(opts.dsec_bin)
    try:
        doc = asyncio.run(run(opts, job))
    except KeyboardInterrupt:
        print("interrupted; deleting the job's sandboxes", file=sys.stderr)
        asyncio.run(cleanup(job))
        return 130
    if opts.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print_table(doc)
    return 0 if doc["totals"]["passed"] == doc["totals"]["tasks"] else 1


if __name__ == "__main__":
    sys.exit(main())
