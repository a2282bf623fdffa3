"""Integration tests against a real dsec daemon.

Skipped unless DSEC_ENDPOINT and DSEC_API_KEY are set; the Go e2e suite
(test/e2e/python_test.go) runs them against its own `dsec up`. Layers:
DSEC_TEST_BASE (default base/e2e:v1, needs busybox and bash), and optionally
DSEC_TEST_WORKSPACE / DSEC_TEST_TOOLKIT (the e2e suite's workspace puts
/repo/a.txt = "workspace", its toolkit overrides it with "toolkit").
Every sandbox carries a per-run label and is deleted at the end.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import unittest
import uuid

import fakeserver  # noqa: F401  (puts the source tree on sys.path)

import libdsec
import libdsec.sync
from libdsec import DSecClient, DSecContainerRunArgs

ENDPOINT = os.environ.get("DSEC_ENDPOINT", "")
API_KEY = os.environ.get("DSEC_API_KEY", "")
BASE = os.environ.get("DSEC_TEST_BASE") or "base/e2e:v1"
WORKSPACE = os.environ.get("DSEC_TEST_WORKSPACE", "")
TOOLKIT = os.environ.get("DSEC_TEST_TOOLKIT", "")
LISTING = os.environ.get("DSEC_TEST_LISTING", "") == "1"
PYPI_URL = os.environ.get("DSEC_TEST_PYPI_URL", "")
NPM_URL = os.environ.get("DSEC_TEST_NPM_URL", "")
RUN = {"libdsec-test": uuid.uuid4().hex[:12]}

skip = unittest.skipUnless(ENDPOINT and API_KEY, "integration tests need DSEC_ENDPOINT and DSEC_API_KEY")


def args(**kw) -> DSecContainerRunArgs:
    labels = dict(RUN)
    labels.update(kw.pop("labels", {}))
    kw.setdefault("container_image", BASE)
    return DSecContainerRunArgs(labels=labels, **kw)


def tearDownModule() -> None:
    if not (ENDPOINT and API_KEY):
        return

    async def cleanup() -> None:
        async with DSecClient() as c:
            await c.delete(labels=RUN)

    asyncio.run(cleanup())


@skip
class IntegrationTest(unittest.IsolatedAsyncioTestCase):
    async def asyncSetUp(self) -> None:
        asyncio.get_running_loop().slow_callback_duration = 5.0
        self.client = DSecClient()
        await self.client.open()

    async def asyncTearDown(self) -> None:
        await self.client.close()

    @unittest.skipUnless(LISTING, "needs DSEC_TEST_LISTING=1 (layers workspace/t1:v1 and toolkit/harness:v1, as the Go e2e suite builds them)")
    async def test_listing(self):
        # DSec's listing verbatim, but for the image name (the e2e base).
        client = DSecClient()                      # DSEC_ENDPOINT / DSEC_API_KEY / ~/.config/dsec/config.json
        await client.open()
        args = DSecContainerRunArgs(container_image=BASE, workspace="workspace/t1:v1",
                                    toolkits=["toolkit/harness:v1"], memory_limit_mb=4096, cpu_cores_limit=4,
                                    ttl_running_stop=300, network_rules={"npm": False, "pypi": True},
                                    init_user="root", labels={"job": "grpo-1"})
        sandbox = await client.run_container(args, timeout=120)
        result = await sandbox.run_shell("echo hello world")    # .exit_code .stdout .stderr .timed_out
        try:
            self.assertEqual((result.exit_code, result.stdout, result.stderr, result.timed_out), (0, "hello world\n", "", False))
            spec = sandbox.info.spec
            self.assertEqual((spec.get("memory_mb"), spec.get("cpu"), spec.get("idle_timeout"), spec.get("user")), (4096, 4, 300, "root"))
            self.assertEqual(spec.get("network"), {"allow": ["pypi"], "deny": ["npm"]})
            self.assertEqual((await sandbox.run_shell("cat /repo/a.txt")).stdout, "workspace\n")
            if PYPI_URL:
                # pypi: True lets the sandbox reach the (test) index by name;
                # npm: False keeps the other one out.
                r = await sandbox.exec(["/opt/netprobe", "get", PYPI_URL])
                self.assertEqual((r.exit_code, r.stdout), (0, "200 hello from pypi"))
                r = await sandbox.exec(["/opt/netprobe", "get", NPM_URL])
                self.assertNotEqual(r.exit_code, 0, r.stdout)
        finally:
            await sandbox.stop()
            await client.close()
        with self.assertRaises(libdsec.SandboxNotFound):
            await self.client.get(sandbox.id)  # deleted sandboxes are gone

    @unittest.skipUnless(LISTING and PYPI_URL, "needs the e2e suite's network (DSEC_TEST_PYPI_URL)")
    async def test_network_rules_change_live(self):
        probe = ["/opt/netprobe", "get"]
        async with self.client.run_container(args(toolkits=["toolkit/harness:v1"], network_rules={"pypi": True})) as sb:
            self.assertEqual((await sb.exec(probe + [PYPI_URL])).exit_code, 0)
            self.assertNotEqual((await sb.exec(probe + [NPM_URL])).exit_code, 0)
            info = await sb.set_network_rules({"npm": True, "pypi": False})
            self.assertEqual(info.spec.get("network"), {"allow": ["npm"], "deny": ["pypi"]})
            self.assertEqual((await sb.exec(probe + [NPM_URL])).stdout, "200 hello from npm")
            self.assertNotEqual((await sb.exec(probe + [PYPI_URL])).exit_code, 0)
            info = await sb.set_network()
            self.assertIsNone(info.spec.get("network"))
            self.assertNotEqual((await sb.exec(probe + [NPM_URL])).exit_code, 0)

    async def test_fncall(self):
        r = await self.client.fncall(BASE, "cat in.txt; echo x > out.txt", files={"in.txt": b"hello\n"}, fetch_files=["out.txt", "nope"])
        self.assertEqual((r["exit_code"], r["stdout"], r["files"], r["missing"]), (0, "hello\n", {"out.txt": b"x\n"}, ["nope"]))
        r = await self.client.fncall(BASE, 'cat; printf "$A"', stdin=b"\xff", env={"A": "\\376"})
        self.assertEqual((r["exit_code"], r["stdout_bytes"], r["stderr_bytes"]), (0, b"\xff\xfe", b""))
        with self.assertRaises(libdsec.InvalidArgument):
            await self.client.fncall(BASE, "true", files={"/etc/passwd": b""})

    async def test_bad_network_rule_is_refused_clearly(self):
        with self.assertRaises(libdsec.InvalidArgument) as cm:
            await self.client.run_container(args(network_rules={"nosuchpreset": True}))
        self.assertIn("nosuchpreset", cm.exception.message)
        self.assertEqual(await self.client.list(labels={**RUN, "never": "made"}), [])

    async def test_exec_forms(self):
        async with self.client.run_container(args(env={"FROM_SPEC": "spec"})) as sb:
            r = await sb.exec(["cat"], stdin=b"\x00\x01binary\xff")
            self.assertEqual(r.stdout_bytes, b"\x00\x01binary\xff")
            r = await sb.exec("echo $FROM_SPEC $X; pwd", env={"X": "x"}, cwd="/tmp")
            self.assertEqual(r.stdout, "spec x\n/tmp\n")
            r = await sb.run_shell("echo out; echo err >&2; exit 7")
            self.assertEqual((r.exit_code, r.stdout, r.stderr, r.ok), (7, "out\n", "err\n", False))
            t0 = time.monotonic()
            r = await sb.run_shell("sleep 30", timeout=1)
            self.assertTrue(r.timed_out)
            self.assertLess(time.monotonic() - t0, 15)
            r = await sb.exec(["sh", "-c", "head -c 3000 /dev/zero"], max_output_bytes=1000)
            self.assertTrue(r.truncated)
            self.assertEqual(len(r.stdout), 1000)

    async def test_streaming(self):
        async with self.client.run_container(args()) as sb:
            chunks = []
            arrived = []  # when each chunk came
            async with sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.5; done; echo bad >&2; exit 3") as st:
                async for ch in st:
                    arrived.append(time.monotonic())
                    chunks.append(ch)
            self.assertEqual(st.status.exit_code, 3)
            self.assertEqual(b"".join(c.data for c in chunks if c.stream == "stdout"), b"1\n2\n3\n")
            self.assertEqual(b"".join(c.data for c in chunks if c.stream == "stderr"), b"bad\n")
            # Output comes while the command runs, spread over its 1.5 s of
            # sleeps, not all at the end (how soon depends on the host's load).
            self.assertGreaterEqual(arrived[-1] - arrived[0], 0.5, "output arrives while the command runs")
            res = await sb.exec_stream(["sh", "-c", "printf '\\377x'"]).collect()
            self.assertEqual((res.exit_code, res.stdout_bytes), (0, b"\xffx"))

    async def test_session_state(self):
        async with self.client.run_container(args()) as sb:
            async with sb.session(cwd="/") as s:
                await s.run("mkdir -p /work && cd /work && export GREETING=hi && f() { echo fn-$1; }")
                r = await s.run("pwd; echo $GREETING; f x")
                self.assertEqual(r.stdout, "/work\nhi\nfn-x\n")
                sid = s.id
            # Closed at the end of the block.
            with self.assertRaises(libdsec.NotFound):
                await self.client._call("POST", f"/v1/sandboxes/{sb.id}/sessions/{sid}/run", json_body={"command": "true"})

    async def test_files_round_trip(self):
        async with self.client.run_container(args()) as sb:
            blob = bytes(range(256)) * 40
            fe = await sb.write_file("/data/sub/blob.bin", blob, mode=0o600)
            self.assertEqual((fe.size, fe.mode), (len(blob), "0600"))
            self.assertEqual(await sb.read_file("/data/sub/blob.bin"), blob)
            self.assertEqual((await sb.stat("/data/sub")).type, "dir")
            self.assertEqual([e.path for e in await sb.list_dir("/data", depth=2)], ["/data/sub", "/data/sub/blob.bin"])
            with self.assertRaises(libdsec.NotFound) as cm:
                await sb.read_file("/data/absent")
            self.assertNotIsInstance(cm.exception, libdsec.SandboxNotFound)
            await sb.remove("/data", recursive=True)
            with self.assertRaises(libdsec.NotFound):
                await sb.stat("/data")

            with tempfile.TemporaryDirectory() as d:
                src = os.path.join(d, "src")
                os.makedirs(os.path.join(src, "pkg", "deep"))
                files = {"pkg/__init__.py": b"", "pkg/deep/m.py": b"X = 1\n", "README": b"readme\n", "bin.dat": os.urandom(5000)}
                for name, data in files.items():
                    with open(os.path.join(src, name), "wb") as f:
                        f.write(data)
                os.symlink("README", os.path.join(src, "link"))
                res = await sb.upload_dir(src, "/repo/up")
                self.assertEqual(res.files, len(files) + 3)  # + pkg, pkg/deep, link
                r = await sb.run_shell("cd /repo/up && cat pkg/deep/m.py link && ls -l link")
                self.assertTrue(r.stdout.startswith("X = 1\nreadme\n"), r)
                self.assertIn("-> README", r.stdout)
                out = os.path.join(d, "out")
                names = await sb.download_dir("/repo/up", out)
                self.assertIn("pkg/deep/m.py", [n.rstrip("/") for n in names])
                for name, data in files.items():
                    with open(os.path.join(out, name), "rb") as f:
                        self.assertEqual(f.read(), data, name)
                self.assertEqual(os.readlink(os.path.join(out, "link")), "README")

    async def test_pause_resume(self):
        job = {"pause-job": uuid.uuid4().hex[:8]}
        async with self.client.run_container(args(labels=job)) as sb:
            await sb.run_shell("echo before > /root/state")
            p = await sb.pause()
            self.assertEqual(p.sandbox.state, "paused")
            self.assertEqual((await sb.refresh()).state, "paused")
            await sb.resume()
            self.assertEqual(sb.state, "running")
            self.assertEqual(await self.client.pause(labels=job), 1)
            # Any exec resumes a paused sandbox first.
            self.assertEqual((await sb.run_shell("cat /root/state")).stdout, "before\n")
            await self.client.pause(labels=job)
            self.assertEqual(await self.client.resume(labels=job), 1)
            self.assertEqual((await sb.refresh()).state, "running")

    async def test_snapshot_and_fork(self):
        async with self.client.run_container(args()) as sb:
            await sb.run_shell("echo snap > /root/state; mkdir -p /root/.cache && echo secret > /root/.cache/c")
            ref = f"snapshot/libdsec-{RUN['libdsec-test']}:{int(time.time() * 1000)}"
            layer = await sb.snapshot(ref, exclude=["/root/.cache"])
            self.assertEqual((layer.ref, layer.kind), (ref, "snapshot"))
            self.assertTrue(layer.digest.startswith("sha256:"))
            async with self.client.run_container(args(snapshot=ref, container_image=None)) as child:
                r = await child.run_shell("cat /root/state; test -e /root/.cache/c && echo LEAK")
                self.assertEqual(r.stdout, "snap\n")
            forks = await sb.fork(2, labels={"fork": "yes"})
            try:
                self.assertEqual(len(forks), 2)
                for i, f in enumerate(forks):
                    self.assertEqual(f.labels.get("fork"), "yes")
                    self.assertEqual(f.labels.get("libdsec-test"), RUN["libdsec-test"])
                    await f.run_shell(f"echo f{i} >> /root/state")
                for i, f in enumerate(forks):
                    self.assertEqual((await f.run_shell("cat /root/state")).stdout, f"snap\nf{i}\n")
                self.assertEqual((await sb.run_shell("cat /root/state")).stdout, "snap\n")
            finally:
                await asyncio.gather(*(f.stop() for f in forks))

    async def test_batch_list_delete_by_labels(self):
        job = {"batch-job": uuid.uuid4().hex[:8]}
        sbs = await self.client.run_containers(args(labels=job), 3)
        self.assertEqual(len({s.id for s in sbs}), 3)
        listed = await self.client.list(labels=job)
        self.assertEqual(sorted(s.id for s in listed), sorted(s.id for s in sbs))
        self.assertEqual(await self.client.delete(labels=job), 3)
        running = await self.client.list(labels=job, state="running")
        self.assertEqual(running, [])

    async def test_layer_gc_dry_run(self):
        # A dry run only lists (other tests share the daemon); what a
        # running sandbox uses is never among it.
        async with self.client.run_container(args()):
            res = await self.client.gc_layers(dry_run=True)
            base = await self.client.get_layer(BASE)
        self.assertTrue(res.dry_run)
        self.assertGreaterEqual(res.removed_bytes, 0)
        self.assertTrue(all(d.startswith("sha256:") for d in res.removed), res.removed)
        self.assertNotIn(base.digest, res.removed)

    async def test_errors(self):
        with self.assertRaises(libdsec.SandboxNotFound):
            await self.client.get("sb-nosuchnode-0000")
        sb = await self.client.run_container(args())
        await sb.stop()
        await sb.stop()  # idempotent
        with self.assertRaises(libdsec.SandboxNotFound):
            await sb.run_shell("true")
        with self.assertRaises(libdsec.InvalidArgument):
            await self.client.run_container(args(memory_limit_mb=-1))
        with self.assertRaises(libdsec.InvalidArgument):
            await self.client.run_container(args(container_image=None))
        with self.assertRaises(libdsec.NotFound):
            await self.client.run_container(args(container_image="base/libdsec-absent:v0"))
        bad = DSecClient(api_key="wrong-key")
        with self.assertRaises(libdsec.Unauthenticated):
            await bad.list()
        await bad.close()

    async def test_concurrent_execs_share_a_small_pool(self):
        c = DSecClient(max_connections=8)
        try:
            async with c.run_container(args()) as sb:
                rs = await asyncio.gather(*(sb.run_shell(f"echo {i}") for i in range(64)))
                self.assertEqual([r.stdout for r in rs], [f"{i}\n" for i in range(64)])
                self.assertLessEqual(c._pool.opened_total, 8)
        finally:
            await c.close()

    async def test_keepalive_stats_log(self):
        async with self.client.run_container(args(ttl=600)) as sb:
            info = await sb.keepalive(1200)
            self.assertTrue(info.expires_at)
            st = await sb.stats()
            self.assertGreater(st.pids, 0)
            await sb.run_shell("echo logged")
            entries = await sb.log_all()
            self.assertIn("exec", [e.kind for e in entries])
            self.assertEqual([e.seq for e in entries], sorted(e.seq for e in entries))


@skip
class SyncIntegrationTest(unittest.TestCase):
    def test_sync_facade(self):
        with libdsec.sync.DSecClient() as c:
            with c.run_container(args(), timeout=120) as sb:
                self.assertEqual(sb.run_shell("echo sync").stdout, "sync\n")
                with sb.session() as s:
                    s.run("cd /tmp")
                    self.assertEqual(s.run("pwd").stdout, "/tmp\n")
                out = b"".join(ch.data for ch in sb.exec_stream("echo a; echo b"))
                self.assertEqual(out, b"a\nb\n")
                sb.write_file("/x", b"y")
                self.assertEqual(sb.read_file("/x"), b"y")
            with self.assertRaises(libdsec.SandboxNotFound):
                c.get(sb.id)


if __name__ == "__main__":
    unittest.main()
