"""The libdsec side of `dsec bench e2b`: one long-lived python3 process,
so that the interpreter's start-up and the import are not counted. For
each line "flow" on stdin it runs run_container → exec("echo hi") →
delete through libdsec and answers one JSON line of its timings in
milliseconds (or {"error": "..."}). The endpoint and key come from
DSEC_ENDPOINT and DSEC_API_KEY. Arguments: TEMPLATE LABEL (LABEL goes in
the labels, so that the bench can delete what a failed flow left behind).
"""

import asyncio
import json
import platform
import sys
import time
import traceback

import libdsec
from libdsec import DSecClient, DSecContainerRunArgs


def say(o):
    sys.stdout.write(json.dumps(o) + "\n")
    sys.stdout.flush()


async def discard(client, sandbox_id):
    """Delete a sandbox after a failure, keeping the failure's own error."""
    try:
        await client.delete_sandbox(sandbox_id)
    except Exception:
        pass


class FlowFailed(Exception):
    """A step that failed, named."""


async def flow(client, template, label):
    t0 = time.perf_counter()
    try:
        sandbox = await client.run_container(DSecContainerRunArgs(container_image=template, labels={"bench": label}))
    except Exception as e:
        raise FlowFailed(f"run_container: {type(e).__name__}: {e}") from e
    t1 = time.perf_counter()
    try:
        # The command the E2B SDK runs for commands.run: bash as a login shell.
        res = await sandbox.exec(["/bin/bash", "-l", "-c", "echo hi"])
    except BaseException as e:
        await discard(client, sandbox.id)
        raise FlowFailed(f"exec: {type(e).__name__}: {e}") from e
    t2 = time.perf_counter()
    if res.exit_code != 0 or res.stdout != "hi\n":
        await discard(client, sandbox.id)
        raise FlowFailed(f"exec: echo hi: exit {res.exit_code}, stdout {res.stdout!r}, stderr {res.stderr!r}")
    try:
        await client.delete_sandbox(sandbox.id)
    except Exception as e:
        raise FlowFailed(f"delete_sandbox: {type(e).__name__}: {e}") from e
    t3 = time.perf_counter()
    ms = 1000.0
    return {"create_ms": (t1 - t0) * ms, "run_ms": (t2 - t1) * ms, "kill_ms": (t3 - t2) * ms, "flow_ms": (t3 - t0) * ms}


async def main():
    template, label = sys.argv[1], sys.argv[2]
    client = DSecClient()
    loop = asyncio.get_running_loop()
    say({"ready": True, "version": f"libdsec {libdsec.__version__}, python {platform.python_version()}"})
    try:
        while True:
            # Reading stdin blocks, so a thread does it; the loop stays free.
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            if line.strip() != "flow":
                say({"error": f"unknown command {line!r}"})
                continue
            try:
                say(await flow(client, template, label))
            except FlowFailed as e:
                say({"error": str(e)})
            except Exception:
                say({"error": traceback.format_exc()})
    finally:
        await client.close()


asyncio.run(main())
