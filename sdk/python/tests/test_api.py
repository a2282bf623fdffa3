"""Unit tests of the API surface against the fake server: what is sent,
how answers and errors are read."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle
import tarfile
import tempfile
import threading
import unittest

from fakeserver import AsyncTest, FakeServer, Reply, Request, error_reply, json_reply

import libdsec
import libdsec.sync
from libdsec.errors import error_from_response


def sandbox_doc(sid: str = "sb-e-1", **kw) -> dict:
    d = {"id": sid, "node": "e", "backend": "container", "state": "running", "spec": {}, "created_at": "t"}
    d.update(kw)
    return d


class Router:
    """Routes (method, path) to canned replies and records the calls."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], object] = {}

    def on(self, method: str, path: str, reply) -> None:
        self.routes[(method, path)] = reply

    async def __call__(self, req: Request):
        r = self.routes.get((req.method, req.path))
        if r is None:
            return error_reply(404, "not_found", f"no such endpoint: {req.method} {req.path}")
        if callable(r):
            r = r(req)
            if asyncio.iscoroutine(r):
                r = await r
        return r


class SpecTest(unittest.TestCase):
    def test_listing_maps_to_sandbox_spec(self):
        args = libdsec.DSecContainerRunArgs(
            container_image="base/python:3.11",
            workspace="workspace/t1:v1",
            toolkits=["toolkit/harness:v1"],
            memory_limit_mb=4096,
            cpu_cores_limit=4,
            ttl_running_stop=300,
            network_rules={"npm": False, "pypi": True},
            init_user="root",
            labels={"job": "grpo-1"},
        )
        self.assertEqual(
            args.to_spec(),
            {
                "base": "base/python:3.11",
                "workspace": "workspace/t1:v1",
                "toolkits": ["toolkit/harness:v1"],
                "cpu": 4.0,
                "memory_mb": 4096,
                "idle_timeout": 300,
                "network": {"allow": ["pypi"], "deny": ["npm"]},
                "user": "root",
                "labels": {"job": "grpo-1"},
            },
        )

    def test_optional_fields(self):
        args = libdsec.DSecContainerRunArgs(
            snapshot="snapshot/s:1", ttl=600, env={"A": "1"}, workdir="/repo", pids_limit=64, qos="be", network_rules={"npm": False},
            memory_cgroup="shared",
        )
        self.assertEqual(
            args.to_spec(),
            {"snapshot": "snapshot/s:1", "pids": 64, "ttl": 600, "network": {"deny": ["npm"]}, "env": {"A": "1"}, "workdir": "/repo", "qos": "be",
             "memory_cgroup": "shared"},
        )
        self.assertEqual(libdsec.DSecContainerRunArgs().to_spec(), {})

    def test_bad_rules(self):
        with self.assertRaises(TypeError):
            libdsec.DSecContainerRunArgs(network_rules={"pypi": "yes"}).to_spec()  # type: ignore[dict-item]
        with self.assertRaises(TypeError):
            libdsec.DSecContainerRunArgs(toolkits="toolkit/x:1").to_spec()  # type: ignore[arg-type]

    def test_exec_result_bytes(self):
        r = libdsec.ExecResult.from_json(
            {"exit_code": 3, "stdout": "\ufffd", "stdout_b64": base64.b64encode(b"\xff").decode(), "stderr": "e", "timed_out": True, "truncated": True, "duration_ms": 7}
        )
        self.assertEqual((r.exit_code, r.stdout_bytes, r.stderr_bytes, r.timed_out, r.truncated, r.duration_ms), (3, b"\xff", b"e", True, True, 7))
        self.assertFalse(r.ok)


class ErrorMappingTest(unittest.TestCase):
    def test_codes(self):
        cases = {
            ("invalid_argument", 400): libdsec.InvalidArgument,
            ("unauthenticated", 401): libdsec.Unauthenticated,
            ("permission_denied", 403): libdsec.PermissionDenied,
            ("not_found", 404): libdsec.NotFound,
            ("already_exists", 409): libdsec.AlreadyExists,
            ("failed_precondition", 409): libdsec.FailedPrecondition,
            ("quota_exceeded", 429): libdsec.QuotaExceeded,
            ("resource_exhausted", 503): libdsec.CapacityExhausted,
            ("unavailable", 503): libdsec.Unavailable,
            ("internal", 500): libdsec.InternalError,
        }
        for (code, status), cls in cases.items():
            body = json.dumps({"error": {"code": code, "message": "m"}}).encode()
            e = error_from_response(status, body, method="POST", path="/v1/layers")
            self.assertIs(type(e), cls, code)
            self.assertIsInstance(e, libdsec.DSecError)
            self.assertEqual((e.code, e.message, e.status), (code, "m", status))
            self.assertEqual(str(e), f"{code}: m")

    def test_sandbox_not_found(self):
        nf = json.dumps({"error": {"code": "not_found", "message": "sandbox sb-e-9 not found"}}).encode()
        for path in ("/v1/sandboxes/sb-e-9", "/v1/sandboxes/sb-e-9/exec", "/v1/sandboxes/sb-e-9/files"):
            self.assertIs(type(error_from_response(404, nf, path=path)), libdsec.SandboxNotFound, path)
        # A missing file or session of an existing sandbox is a plain NotFound.
        f = json.dumps({"error": {"code": "not_found", "message": "/x: no such file"}}).encode()
        self.assertIs(type(error_from_response(404, f, path="/v1/sandboxes/sb-e-9/files")), libdsec.NotFound)
        s = json.dumps({"error": {"code": "not_found", "message": "session s1 not found in sandbox sb-e-9"}}).encode()
        self.assertIs(type(error_from_response(404, s, path="/v1/sandboxes/sb-e-9/sessions/s1/run")), libdsec.NotFound)
        self.assertIs(type(error_from_response(404, f, path="/v1/layers/x")), libdsec.NotFound)

    def test_non_json_bodies(self):
        e = error_from_response(502, b"<html>bad gateway</html>")
        self.assertIs(type(e), libdsec.Unavailable)
        self.assertIn("bad gateway", e.message)
        e = error_from_response(409, b"conflict")
        self.assertIs(type(e), libdsec.DSecError)
        self.assertEqual(e.status, 409)
        e = error_from_response(418, b'{"error":{"code":"teapot","message":"short and stout"}}')
        self.assertEqual((type(e), e.code), (libdsec.DSecError, "teapot"))


class ClientTest(AsyncTest):
    async def asyncSetUp(self) -> None:
        await super().asyncSetUp()
        self.r = Router()
        self.srv = FakeServer(self.r)
        await self.srv.__aenter__()
        self.c = libdsec.DSecClient(self.srv.endpoint, "key-1", backoff_base=0.001)

    async def asyncTearDown(self) -> None:
        await self.c.close()
        await self.srv.__aexit__(None, None, None)

    def calls(self) -> list[tuple[str, str]]:
        return [(q.method, q.path) for q in self.srv.requests]

    async def test_run_container_and_run_shell(self):
        self.r.on("POST", "/v1/sandboxes", lambda q: json_reply(201, sandbox_doc(labels=q.json()["labels"])))
        self.r.on("POST", "/v1/sandboxes/sb-e-1/exec", lambda q: json_reply(200, {"exit_code": 0, "stdout": "hello world\n", "stderr": "", "timed_out": False, "truncated": False, "duration_ms": 3}))
        self.r.on("DELETE", "/v1/sandboxes/sb-e-1", Reply(204))
        args = libdsec.DSecContainerRunArgs(container_image="base/e2e:v1", labels={"job": "j"}, network_rules={"npm": False})
        sb = await self.c.run_container(args, timeout=120)
        self.assertEqual((sb.id, sb.state, sb.labels), ("sb-e-1", "running", {"job": "j"}))
        res = await sb.run_shell("echo hello world")
        self.assertEqual((res.exit_code, res.stdout, res.stderr, res.timed_out), (0, "hello world\n", "", False))
        await sb.stop()
        await sb.stop()  # idempotent
        create = self.srv.requests[0]
        self.assertEqual(create.headers["content-type"], "application/json")
        self.assertEqual(create.json(), {"base": "base/e2e:v1", "network": {"deny": ["npm"]}, "labels": {"job": "j"}})
        self.assertEqual(self.srv.requests[1].json(), {"cmd": "echo hello world"})
        self.assertEqual(self.calls()[2:], [("DELETE", "/v1/sandboxes/sb-e-1")] * 2)

    async def test_failed_precondition_passes_through(self):
        msg = "network allow rules are not supported by this release: sandboxes are loopback-only; omit network.allow"
        self.r.on("POST", "/v1/sandboxes", error_reply(409, "failed_precondition", msg))
        with self.assertRaises(libdsec.FailedPrecondition) as cm:
            await self.c.run_container(libdsec.DSecContainerRunArgs(container_image="b/x:1", network_rules={"pypi": True}))
        self.assertEqual(cm.exception.message, msg)
        self.assertEqual(cm.exception.status, 409)

    async def test_async_with_always_deletes(self):
        self.r.on("POST", "/v1/sandboxes", json_reply(201, sandbox_doc()))
        self.r.on("DELETE", "/v1/sandboxes/sb-e-1", Reply(204))
        with self.assertRaises(ZeroDivisionError):
            async with self.c.run_container(libdsec.DSecContainerRunArgs(container_image="b/x:1")) as sb:
                self.assertEqual(sb.id, "sb-e-1")
                1 / 0
        self.assertEqual(self.calls()[-1], ("DELETE", "/v1/sandboxes/sb-e-1"))

    async def test_exec_request_forms(self):
        bodies = []

        def ex(q: Request):
            bodies.append(q.json())
            return json_reply(200, {"exit_code": 1, "stdout": "", "stderr": "", "timed_out": True})

        self.r.on("POST", "/v1/sandboxes/sb-e-1/exec", ex)
        sb = self.c.sandbox("sb-e-1")
        r = await sb.exec(["cat"], cwd="/repo", env={"A": "b"}, stdin=b"\x00\xff", timeout=5, user="nobody", max_output_bytes=10)
        self.assertTrue(r.timed_out)
        await sb.exec("cat", stdin="text")
        self.assertEqual(bodies[0], {"argv": ["cat"], "cwd": "/repo", "env": {"A": "b"}, "user": "nobody", "stdin_b64": "AP8=", "timeout": 5, "max_output_bytes": 10})
        self.assertEqual(bodies[1], {"cmd": "cat", "stdin": "text"})
        with self.assertRaises(TypeError):
            await sb.exec([])
        with self.assertRaises(TypeError):
            await sb.run_shell(["ls"])  # type: ignore[arg-type]

    async def test_exec_stream(self):
        lines = [
            {"stdout": "hel"},
            {"stderr": "warn\n"},
            {"stdout_b64": base64.b64encode(b"\xfflo\n").decode()},
            {"exit_code": 2, "timed_out": False, "truncated": False, "duration_ms": 12},
        ]
        raw = b"".join(json.dumps(l).encode() + b"\n" for l in lines)
        pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]  # lines split across chunks
        self.r.on("POST", "/v1/sandboxes/sb-e-1/exec", Reply(200, chunks=pieces, headers={"Content-Type": "application/x-ndjson"}))
        sb = self.c.sandbox("sb-e-1")
        got = []
        async with sb.exec_stream("make", timeout=10) as st:
            async for ch in st:
                got.append((ch.stream, ch.data))
        self.assertEqual(got, [("stdout", b"hel"), ("stderr", b"warn\n"), ("stdout", b"\xfflo\n")])
        self.assertEqual(st.status, libdsec.ExecStatus(exit_code=2, duration_ms=12))
        self.assertEqual(self.srv.requests[0].query, {"stream": ["true"]})
        res = await sb.exec_stream("make").collect()
        self.assertEqual((res.exit_code, res.stdout_bytes, res.stderr), (2, b"hel\xfflo\n", "warn\n"))
        self.assertEqual(self.srv.accepted, 1, "a finished stream returns its connection")

    async def test_exec_stream_errors(self):
        err = b'{"stdout":"a"}\n{"error":{"code":"unavailable","message":"edge lost the command"}}\n'
        self.r.on("POST", "/v1/sandboxes/sb-e-1/exec", Reply(200, chunks=[err]))
        with self.assertRaises(libdsec.Unavailable) as cm:
            async for _ in self.c.sandbox("sb-e-1").exec_stream("x"):
                pass
        self.assertEqual(cm.exception.message, "edge lost the command")
        self.r.on("POST", "/v1/sandboxes/sb-e-1/exec", Reply(200, chunks=[b'{"stdout":"a"}\n']))
        with self.assertRaises(libdsec.ProtocolError):
            await self.c.sandbox("sb-e-1").exec_stream("x").wait()
        self.r.on("POST", "/v1/sandboxes/sb-e-2/exec", error_reply(404, "not_found", "sandbox sb-e-2 not found"))
        with self.assertRaises(libdsec.SandboxNotFound):
            await self.c.sandbox("sb-e-2").exec_stream("x").wait()

    async def test_exec_stream_early_exit_drops_connection(self):
        self.r.on("POST", "/v1/sandboxes/sb-e-1/exec", Reply(200, chunks=[b'{"stdout":"1"}\n'] * 50, chunk_delay=0.01))
        async with self.c.sandbox("sb-e-1").exec_stream("yes") as st:
            async for _ in st:
                break
        self.assertEqual(self.c._pool.in_use, 0)
        self.assertIsNone(st.status)

    async def test_session(self):
        self.r.on("POST", "/v1/sandboxes/sb-e-1/sessions", json_reply(201, {"session_id": "s1"}))
        self.r.on("POST", "/v1/sandboxes/sb-e-1/sessions/s1/run", lambda q: json_reply(200, {"exit_code": 0, "stdout": q.json()["command"], "stderr": ""}))
        self.r.on("DELETE", "/v1/sandboxes/sb-e-1/sessions/s1", Reply(204))
        sb = self.c.sandbox("sb-e-1")
        with self.assertRaises(RuntimeError):
            async with sb.session(cwd="/repo", env={"X": "1"}) as s:
                self.assertEqual((await s.run("cd /repo", timeout=5)).stdout, "cd /repo")
                raise RuntimeError("boom")
        self.assertEqual(
            self.calls(),
            [("POST", "/v1/sandboxes/sb-e-1/sessions"), ("POST", "/v1/sandboxes/sb-e-1/sessions/s1/run"), ("DELETE", "/v1/sandboxes/sb-e-1/sessions/s1")],
        )
        self.assertEqual(self.srv.requests[0].json(), {"cwd": "/repo", "env": {"X": "1"}})
        self.assertEqual(self.srv.requests[1].json(), {"command": "cd /repo", "timeout": 5})

    async def test_files(self):
        blob = bytes(range(256)) * 1000
        self.r.on("GET", "/v1/sandboxes/sb-e-1/files", lambda q: Reply(200, body=blob) if q.query["path"] == ["/a b/c"] else error_reply(404, "not_found", "/nope: not found"))
        self.r.on("PUT", "/v1/sandboxes/sb-e-1/files", lambda q: json_reply(200, {"path": q.query["path"][0], "type": "file", "size": len(q.body), "mode": q.query["mode"][0], "mtime": "t"}))
        self.r.on("GET", "/v1/sandboxes/sb-e-1/files:list", lambda q: json_reply(200, {"entries": [{"path": "/r/a", "type": "file", "size": 1, "mode": "0644", "mtime": "t"}]}))
        sb = self.c.sandbox("sb-e-1")
        self.assertEqual(await sb.read_file("/a b/c"), blob)
        with self.assertRaises(libdsec.NotFound) as cm:
            await sb.read_file("/nope")
        self.assertNotIsInstance(cm.exception, libdsec.SandboxNotFound)
        fe = await sb.write_file("/r/x.sh", b"#!/bin/sh\n", mode=0o755)
        self.assertEqual((fe.path, fe.size, fe.mode), ("/r/x.sh", 10, "0755"))
        put = self.srv.requests[-1]
        self.assertEqual((put.body, put.headers["content-type"]), (b"#!/bin/sh\n", "application/octet-stream"))
        ents = await sb.list_dir("/r", depth=2)
        self.assertEqual([e.path for e in ents], ["/r/a"])
        self.assertEqual(self.srv.requests[-1].query, {"path": ["/r"], "depth": ["2"]})
        with tempfile.TemporaryDirectory() as d:
            n = await sb.download_file("/a b/c", os.path.join(d, "c"))
            self.assertEqual(n, len(blob))
            with open(os.path.join(d, "c"), "rb") as f:
                self.assertEqual(f.read(), blob)

    async def test_upload_dir(self):
        got = {}

        def put(q: Request):
            with tarfile.open(fileobj=io.BytesIO(q.body)) as t:
                for m in t.getmembers():
                    got[m.name] = (t.extractfile(m).read() if m.isfile() else m.type, m.uid)  # type: ignore[union-attr]
            return json_reply(200, {"files": len(got), "bytes": 5})

        self.r.on("PUT", "/v1/sandboxes/sb-e-1/files:tar", put)
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "pkg"))
            with open(os.path.join(d, "pkg", "m.py"), "w") as f:
                f.write("x = 1")
            with open(os.path.join(d, "top"), "w") as f:
                f.write("")
            res = await self.c.sandbox("sb-e-1").upload_dir(d, "/repo")
        self.assertEqual(res, libdsec.TarResult(files=3, bytes=5))
        self.assertEqual(got, {"pkg": (tarfile.DIRTYPE, 0), "pkg/m.py": (b"x = 1", 0), "top": (b"", 0)})
        self.assertEqual(self.srv.requests[0].query["path"], ["/repo"])
        self.assertEqual(self.srv.requests[0].headers["content-type"], "application/x-tar")

    async def test_download_dir_and_unsafe_archives(self):
        def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
            b = io.BytesIO()
            with tarfile.open(fileobj=b, mode="w") as t:
                for ti, data in members:
                    ti.size = len(data) if ti.isfile() else 0
                    t.addfile(ti, io.BytesIO(data) if ti.isfile() else None)
            return b.getvalue()

        def ti(name: str, type_=tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
            t = tarfile.TarInfo(name)
            t.type, t.linkname, t.mode = type_, link, 0o755 if type_ == tarfile.DIRTYPE else 0o644
            return t

        archives = {
            "/good": tar_of((ti("d", tarfile.DIRTYPE), b""), (ti("d/f"), b"data"), (ti("d/l", tarfile.SYMTYPE, "f"), b""), (ti("fifo", tarfile.FIFOTYPE), b"")),
            "/dotdot": tar_of((ti("ok"), b"1"), (ti("../evil"), b"x")),
            "/abs": tar_of((ti("/etc/evil"), b"x"),),
            "/abslink": tar_of((ti("l", tarfile.SYMTYPE, "/etc"), b""), (ti("l/passwd"), b"x")),
            "/uplink": tar_of((ti("l", tarfile.SYMTYPE, "../../x"), b""),),
            "/hardlink": tar_of((ti("h", tarfile.LNKTYPE, "../outside"), b""),),
        }
        self.r.on("GET", "/v1/sandboxes/sb-e-1/files:tar", lambda q: Reply(200, chunks=[archives[q.query["path"][0]]]))
        sb = self.c.sandbox("sb-e-1")
        with tempfile.TemporaryDirectory() as d:
            dest = os.path.join(d, "out")
            names = await sb.download_dir("/good", dest)
            self.assertEqual(names, ["d", "d/f", "d/l"])
            with open(os.path.join(dest, "d", "l")) as f:
                self.assertEqual(f.read(), "data")
            self.assertFalse(os.path.exists(os.path.join(dest, "fifo")))
            for bad in ("/dotdot", "/abs", "/abslink", "/uplink", "/hardlink"):
                target = os.path.join(d, "bad" + bad.replace("/", "_"))
                with self.assertRaises(libdsec.UnsafeArchive, msg=bad):
                    await sb.download_dir(bad, target)
                self.assertEqual(os.listdir(target), [], f"{bad}: nothing may be extracted")
            self.assertFalse(os.path.exists(os.path.join(d, "evil")))

    async def test_batch_all_or_nothing(self):
        self.r.on(
            "POST",
            "/v1/sandboxes:batch",
            json_reply(200, {"sandboxes": [sandbox_doc("sb-e-1"), sandbox_doc("sb-e-2")], "errors": [{"index": 2, "error": {"code": "quota_exceeded", "message": "project p: sandboxes 3 > 2"}}]}),
        )
        self.r.on("DELETE", "/v1/sandboxes/sb-e-1", Reply(204))
        self.r.on("DELETE", "/v1/sandboxes/sb-e-2", Reply(204))
        args = libdsec.DSecContainerRunArgs(container_image="b/x:1")
        with self.assertRaises(libdsec.BatchFailed) as cm:
            await self.c.run_containers(args, 3)
        e = cm.exception
        self.assertEqual((e.code, len(e.errors), e.errors[0][0]), ("quota_exceeded", 1, 2))
        self.assertIsInstance(e.errors[0][1], libdsec.QuotaExceeded)
        self.assertEqual(sorted(self.calls()[1:]), [("DELETE", "/v1/sandboxes/sb-e-1"), ("DELETE", "/v1/sandboxes/sb-e-2")])
        self.assertEqual(self.srv.requests[0].json(), {"count": 3, "spec": {"base": "b/x:1"}})
        with self.assertLogs("libdsec", "WARNING") as logs:
            sbs = await self.c.run_containers(args, 3, allow_partial=True)
        self.assertIn("item 2 failed: quota_exceeded", logs.output[0])
        self.assertEqual([s.id for s in sbs], ["sb-e-1", "sb-e-2"])

    async def test_list_pages_and_label_ops(self):
        def lst(q: Request):
            if not q.query.get("page_token"):
                return json_reply(200, {"sandboxes": [sandbox_doc("sb-e-1")], "next_page_token": "p2"})
            return json_reply(200, {"sandboxes": [sandbox_doc("sb-e-2")]})

        self.r.on("GET", "/v1/sandboxes", lst)
        self.r.on("POST", "/v1/sandboxes:delete", lambda q: json_reply(200, {"deleted": len(q.json()["labels"])}))
        self.r.on("POST", "/v1/sandboxes:pause", json_reply(200, {"count": 4}))
        self.r.on("POST", "/v1/sandboxes:resume", json_reply(200, {"count": 5}))
        self.assertEqual([s.id for s in await self.c.list(labels={"job": "j"})], ["sb-e-1", "sb-e-2"])
        self.assertEqual(await self.c.delete(labels={"job": "j"}), 1)
        self.assertEqual(await self.c.pause(labels={"job": "j"}), 4)
        self.assertEqual(await self.c.resume(labels={"job": "j"}), 5)
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.delete(labels={})

    async def test_label_ops_name_unreachable_nodes(self):
        # A call by labels that could not ask some nodes left their
        # sandboxes: it raises, with the count of the others.
        self.r.on("POST", "/v1/sandboxes:delete", json_reply(200, {"deleted": 3, "unreachable_nodes": ["e2"]}))
        self.r.on("POST", "/v1/sandboxes:pause", json_reply(200, {"count": 4, "unreachable_nodes": ["e1", "e3"]}))
        self.r.on("POST", "/v1/sandboxes:resume", json_reply(200, {"count": 5, "unreachable_nodes": ["e3"]}))
        for call, n, nodes, done in [
            (self.c.delete, 3, ["e2"], "deleted 3"),
            (self.c.pause, 4, ["e1", "e3"], "paused 4"),
            (self.c.resume, 5, ["e3"], "resumed 5"),
        ]:
            with self.assertRaises(libdsec.NodesUnreachable) as cm:
                await call(labels={"job": "j"})
            e = cm.exception
            self.assertIsInstance(e, libdsec.Unavailable)
            self.assertEqual((e.count, e.nodes, e.code), (n, nodes, "unavailable"))
            self.assertIn(done, str(e))
            back = pickle.loads(pickle.dumps(e))
            self.assertEqual((type(back), back.count, back.nodes, str(back)), (libdsec.NodesUnreachable, n, nodes, str(e)))
        self.r.on("GET", "/v1/sandboxes", json_reply(200, {"sandboxes": [sandbox_doc("sb-e-1")], "unreachable_nodes": ["e2"]}))
        with self.assertLogs("libdsec", "WARNING") as logs:
            sbs = await self.c.list(labels={"job": "j"})
        self.assertEqual([s.id for s in sbs], ["sb-e-1"])
        self.assertIn("1 node(s) could not be asked, so their sandboxes are not listed: e2", logs.output[0])

    async def test_lifecycle_calls(self):
        sb_paused = sandbox_doc(state="paused")
        self.r.on("POST", "/v1/sandboxes/sb-e-1/pause", json_reply(200, {"sandbox": sb_paused, "memory_before_bytes": 10, "memory_after_bytes": 4, "memory_freed_bytes": 6, "duration_ms": 1}))
        self.r.on("POST", "/v1/sandboxes/sb-e-1/resume", json_reply(200, sandbox_doc()))
        self.r.on("POST", "/v1/sandboxes/sb-e-1/keepalive", json_reply(200, sandbox_doc(expires_at="later")))
        self.r.on("GET", "/v1/sandboxes/sb-e-1/stats", json_reply(200, {"cpu_usage_ns": 1, "memory_bytes": 2, "pids": 3, "disk_bytes": 4}))
        self.r.on("POST", "/v1/sandboxes/sb-e-1/snapshot", lambda q: json_reply(201, {"digest": "sha256:ab", "ref": q.json()["ref"], "kind": "snapshot", "size_bytes": 1, "created_at": "t"}))
        self.r.on("POST", "/v1/sandboxes/sb-e-1/fork", lambda q: json_reply(200, {"sandboxes": [sandbox_doc(f"sb-e-f{i}") for i in range(q.json()["count"])], "errors": []}))
        self.r.on("GET", "/v1/sandboxes/sb-e-1/log", lambda q: json_reply(200, {"entries": [{"seq": 1, "kind": "exec"}] if q.query.get("since_seq") is None else [], "next_seq": 1}))
        sb = self.c.sandbox("sb-e-1")
        p = await sb.pause()
        self.assertEqual((p.memory_freed_bytes, sb.state), (6, "paused"))
        await sb.resume()
        self.assertEqual(sb.state, "running")
        self.assertEqual((await sb.keepalive(600)).expires_at, "later")
        self.assertEqual(self.srv.requests[-1].json(), {"ttl": 600})
        self.assertEqual((await sb.stats()).pids, 3)
        layer = await sb.snapshot("snapshot/s:1", exclude=["/root/.cache"])
        self.assertEqual(layer.ref, "snapshot/s:1")
        self.assertEqual(self.srv.requests[-1].json(), {"ref": "snapshot/s:1", "exclude": ["/root/.cache"]})
        forks = await sb.fork(2, labels={"b": "1"})
        self.assertEqual([f.id for f in forks], ["sb-e-f0", "sb-e-f1"])
        entries = await sb.log_all()
        self.assertEqual([e.seq for e in entries], [1])

    async def test_layer_ref_escaped(self):
        # A ref is one path segment: its '/' and ':' are escaped.
        self.r.on("GET", "/v1/layers/base%2Fpython%3A3.11", json_reply(200, {"digest": "sha256:1", "ref": "base/python:3.11"}))
        layer = await self.c.get_layer("base/python:3.11")
        self.assertEqual(layer.ref, "base/python:3.11")
        self.assertEqual(self.srv.requests[0].target, "/v1/layers/base%2Fpython%3A3.11")


    async def test_gc_layers(self):
        self.r.on("POST", "/v1/layers:gc", lambda q: json_reply(200, {"removed": ["sha256:a", "sha256:b"], "removed_bytes": 4096, "dry_run": q.query.get("dry_run") == ["true"]}))
        res = await self.c.gc_layers(dry_run=True)
        self.assertEqual((res.removed, res.removed_bytes, res.dry_run), (["sha256:a", "sha256:b"], 4096, True))
        self.assertEqual(self.srv.requests[-1].query, {"dry_run": ["true"]})
        res = await self.c.gc_layers()
        self.assertEqual((res.removed_bytes, res.dry_run), (4096, False))
        self.assertEqual(self.srv.requests[-1].query, {})
        self.r.on("POST", "/v1/layers:gc", error_reply(403, "permission_denied", "gc takes a root project key"))
        with self.assertRaises(libdsec.PermissionDenied):
            await self.c.gc_layers()


class SyncFacadeTest(unittest.TestCase):
    def test_sync_client_uses_one_thread(self):
        r = Router()
        r.on("GET", "/healthz", json_reply(200, {"status": "ok", "node": "n"}))
        r.on("POST", "/v1/sandboxes", json_reply(201, sandbox_doc()))
        r.on("POST", "/v1/sandboxes/sb-e-1/exec", json_reply(200, {"exit_code": 0, "stdout": "hi\n", "stderr": ""}))
        r.on("DELETE", "/v1/sandboxes/sb-e-1", Reply(204))
        ready = threading.Event()
        stop: list = []

        def serve():
            async def main():
                async with FakeServer(r) as srv:
                    stop.append((asyncio.get_running_loop(), asyncio.Event(), srv))
                    ready.set()
                    await stop[0][1].wait()

            asyncio.run(main())

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        ready.wait(5)
        loop, ev, srv = stop[0]
        try:
            before = threading.active_count()
            with libdsec.sync.DSecClient(srv.endpoint, "k") as c:
                self.assertEqual(threading.active_count(), before + 1)
                with c.run_container(libdsec.DSecContainerRunArgs(container_image="b/x:1")) as sb:
                    results = [sb.run_shell("echo hi").stdout for _ in range(5)]
                self.assertEqual(results, ["hi\n"] * 5)
                self.assertEqual(threading.active_count(), before + 1)
            self.assertEqual(threading.active_count(), before)
            self.assertEqual(srv.requests[-1].method, "DELETE")
        finally:
            loop.call_soon_threadsafe(ev.set)
            t.join(5)


if __name__ == "__main__":
    unittest.main()


class FailoverTest(AsyncTest):
    """Several endpoints (a cluster's apiservers): a call that cannot reach
    one goes to the next when that is safe."""

    async def test_create_fails_over_with_one_key(self):
        r = Router()
        r.on("POST", "/v1/sandboxes", lambda q: json_reply(201, sandbox_doc()))
        async with FakeServer(r) as good:
            dead = FakeServer(Router())
            await dead.__aenter__()
            dead_ep = dead.endpoint
            await dead.__aexit__(None, None, None)
            c = libdsec.DSecClient(f"{dead_ep},{good.endpoint}", "k", backoff_base=0.001)
            try:
                self.assertEqual(c.endpoints, [dead_ep, good.endpoint])
                sb = await c.run_container(libdsec.DSecContainerRunArgs(container_image="base/e2e:v1"))
                self.assertEqual(sb.id, "sb-e-1")
                self.assertEqual(c.endpoint, good.endpoint)  # it stays there
                key = good.requests[0].headers.get("idempotency-key", "")
                self.assertTrue(key.startswith("dsec-"), key)
                with libdsec.idempotency_key("job-7-step-2"):
                    await c.run_container(libdsec.DSecContainerRunArgs(container_image="base/e2e:v1"))
                self.assertEqual(good.requests[1].headers.get("idempotency-key"), "job-7-step-2")
            finally:
                await c.close()

    async def test_dsec_errors_do_not_fail_over(self):
        bad, good = Router(), Router()
        bad.on("GET", "/v1/sandboxes/sb-e-1", error_reply(503, "unavailable", "node e cannot be reached now"))
        good.on("GET", "/v1/sandboxes/sb-e-1", lambda q: json_reply(200, sandbox_doc()))
        async with FakeServer(bad) as b, FakeServer(good) as g:
            c = libdsec.DSecClient(f"{b.endpoint},{g.endpoint}", "k", backoff_base=0.001, max_retries=1)
            try:
                with self.assertRaises(libdsec.Unavailable):
                    await c.get("sb-e-1")
                self.assertEqual(len(g.requests), 0)
            finally:
                await c.close()

    async def test_gateway_errors_fail_over(self):
        bad, good = Router(), Router()
        bad.on("GET", "/v1/sandboxes/sb-e-1", Reply(502, body=b"<html>bad gateway</html>"))
        good.on("GET", "/v1/sandboxes/sb-e-1", lambda q: json_reply(200, sandbox_doc()))
        async with FakeServer(bad) as b, FakeServer(good) as g:
            c = libdsec.DSecClient(f"{b.endpoint},{g.endpoint}", "k", backoff_base=0.001)
            try:
                sb = await c.get("sb-e-1")
                self.assertEqual(sb.id, "sb-e-1")
                self.assertEqual(len(g.requests), 1)
            finally:
                await c.close()
