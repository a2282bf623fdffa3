"""Unit tests of the HTTP layer: framing, pooling, retries, timeouts."""

from __future__ import annotations

import asyncio
import json
import unittest

from fakeserver import HANG_UP, AsyncTest, FakeServer, Reply, Request, error_reply, json_reply

import libdsec
from libdsec import _http


def client_for(srv: FakeServer, **kw) -> libdsec.DSecClient:
    kw.setdefault("backoff_base", 0.001)
    return libdsec.DSecClient(srv.endpoint, "k", **kw)


class FramingTest(AsyncTest):
    async def test_chunked_json_split_anywhere(self):
        doc = {"id": "sb-e-1", "state": "running", "labels": {"a": "b"}}
        raw = json.dumps(doc).encode()

        async def h(req: Request):
            return Reply(200, chunks=[raw[:1], raw[1:7], raw[7:8], raw[8:]], headers={"Content-Type": "application/json"})

        async with FakeServer(h) as srv:
            c = client_for(srv)
            for _ in range(3):
                sb = await c.get("sb-e-1")
                self.assertEqual(sb.info.labels, {"a": "b"})
            await c.close()
        self.assertEqual(srv.accepted, 1, "chunked answers read to the end keep the connection")

    async def test_close_delimited_body(self):
        async def h(req: Request):
            return Reply(200, body=b'{"status":"ok","node":"n"}', close_delimited=True)

        async with FakeServer(h) as srv:
            c = client_for(srv)
            self.assertEqual((await c.health())["node"], "n")
            self.assertEqual((await c.health())["node"], "n")
            await c.close()
        self.assertEqual(srv.accepted, 2, "a close-delimited answer cannot reuse its connection")

    async def test_no_content_and_keepalive(self):
        async def h(req: Request):
            return Reply(204)

        async with FakeServer(h) as srv:
            c = client_for(srv)
            for _ in range(5):
                await c.delete_sandbox("sb-x")
            await c.close()
        self.assertEqual(srv.accepted, 1)
        self.assertEqual([r.method for r in srv.requests], ["DELETE"] * 5)

    async def test_headers_sent(self):
        async def h(req: Request):
            return json_reply(200, {"sandboxes": []})

        async with FakeServer(h) as srv:
            c = client_for(srv)
            await c.list(labels={"job": "g 1", "a": "x/y"}, state="running")
            await c.close()
        r = srv.requests[0]
        self.assertEqual(r.headers["authorization"], "Bearer k")
        self.assertTrue(r.headers["user-agent"].startswith("libdsec-python/"))
        self.assertEqual(r.headers["host"], f"127.0.0.1:{srv.port}")
        self.assertEqual(r.query["label"], ["a=x/y", "job=g 1"])
        self.assertEqual(r.query["state"], ["running"])

    async def test_endpoint_path_prefix(self):
        async def h(req: Request):
            return json_reply(200, {"status": "ok"})

        async with FakeServer(h) as srv:
            c = libdsec.DSecClient(srv.endpoint + "/dsec/", "k")
            await c.health()
            await c.close()
        self.assertEqual(srv.requests[0].path, "/dsec/healthz")


class PoolTest(AsyncTest):
    async def test_512_concurrent_calls_share_8_connections(self):
        async def h(req: Request):
            await asyncio.sleep(0.002)
            sid = req.path.rsplit("/", 1)[1]
            return json_reply(200, {"id": sid, "state": "running"})

        async with FakeServer(h) as srv:
            c = client_for(srv, max_connections=8)
            ids = [f"sb-e-{i}" for i in range(512)]
            got = await asyncio.gather(*(c.get(i) for i in ids))
            self.assertEqual([s.id for s in got], ids)
            self.assertEqual(c._pool.in_use, 0)
            await c.close()
        self.assertEqual(len(srv.requests), 512)
        self.assertLessEqual(srv.max_open, 8)
        self.assertLessEqual(srv.accepted, 8, "connections are reused, not reopened")

    async def test_stale_idle_connection_is_not_reused(self):
        async def h(req: Request):
            return Reply(200, body=b"{}", close=True)

        async with FakeServer(h) as srv:
            c = client_for(srv, max_retries=0)
            await c.health()
            await asyncio.sleep(0.05)  # the server has closed it by now
            await c.health()  # would fail if the dead connection were reused
            await c.close()
        self.assertEqual(srv.accepted, 2)

    async def test_closed_client_refuses_calls(self):
        async def h(req: Request):
            return json_reply(200, {})

        async with FakeServer(h) as srv:
            c = client_for(srv, max_retries=0)
            await c.close()
            with self.assertRaises(libdsec.ConnectionFailed):
                await c.health()


class RetryTest(AsyncTest):
    async def test_idempotent_get_retried_on_503(self):
        n = 0

        async def h(req: Request):
            nonlocal n
            n += 1
            if n < 3:
                return error_reply(503, "unavailable", "edge e restarting")
            return json_reply(200, {"id": "sb-e-1", "state": "running"})

        async with FakeServer(h) as srv:
            c = client_for(srv)
            sb = await c.get("sb-e-1")
            await c.close()
        self.assertEqual(sb.state, "running")
        self.assertEqual(len(srv.requests), 3)

    async def test_retries_are_bounded(self):
        async def h(req: Request):
            return error_reply(503, "unavailable", "down")

        async with FakeServer(h) as srv:
            c = client_for(srv, max_retries=2)
            with self.assertRaises(libdsec.Unavailable) as cm:
                await c.get("sb-e-1")
            await c.close()
        self.assertEqual(cm.exception.status, 503)
        self.assertEqual(len(srv.requests), 3)

    async def test_exec_not_retried_on_503(self):
        async def h(req: Request):
            return error_reply(503, "unavailable", "edge unreachable")

        async with FakeServer(h) as srv:
            c = client_for(srv)
            with self.assertRaises(libdsec.Unavailable):
                await c.sandbox("sb-e-1").run_shell("echo once")
            await c.close()
        self.assertEqual(len(srv.requests), 1)

    async def test_create_not_retried_on_capacity(self):
        async def h(req: Request):
            return error_reply(503, "resource_exhausted", "no node can hold 4096 MiB")

        async with FakeServer(h) as srv:
            c = client_for(srv)
            with self.assertRaises(libdsec.CapacityExhausted):
                await c.run_container(libdsec.DSecContainerRunArgs(container_image="base/x:1"))
            await c.close()
        self.assertEqual(len(srv.requests), 1)

    async def test_dropped_connection_retried_for_get_not_for_exec(self):
        seen: list[str] = []

        async def h(req: Request):
            seen.append(req.method)
            if len(seen) in (1, 3):
                return HANG_UP
            return json_reply(200, {"id": "sb-e-1", "exit_code": 0, "stdout": "", "stderr": ""})

        async with FakeServer(h) as srv:
            c = client_for(srv)
            await c.get("sb-e-1")  # 1st hangs up, 2nd answers
            with self.assertRaises(libdsec.ConnectionFailed):
                await c.sandbox("sb-e-1").exec(["true"])  # 3rd hangs up: exec is not resent
            await c.close()
        self.assertEqual(seen, ["GET", "GET", "POST"])

    async def test_keyed_exec_resent_after_a_dropped_connection(self):
        seen: list[tuple[str, str]] = []

        async def h(req: Request):
            seen.append((req.method, req.headers.get("idempotency-key", "")))
            if len(seen) == 1:
                return HANG_UP
            return json_reply(200, {"exit_code": 0, "stdout": "", "stderr": ""})

        async with FakeServer(h) as srv:
            c = client_for(srv)
            with libdsec.idempotency_key("step-3"):
                await c.sandbox("sb-e-1").exec(["true"])
            await c.close()
        self.assertEqual(seen, [("POST", "step-3"), ("POST", "step-3")])

    async def test_unkeyed_post_not_resent_after_a_dropped_connection(self):
        seen: list[str] = []

        async def h(req: Request):
            seen.append(req.method)
            return HANG_UP

        async with FakeServer(h) as srv:
            c = client_for(srv)
            with self.assertRaises(libdsec.ConnectionFailed):
                await c.sandbox("sb-e-1").session().open()
            await c.close()
        self.assertEqual(seen, ["POST"])

    async def test_connect_failure_retried_even_for_exec(self):
        async def h(req: Request):
            return json_reply(200, {"exit_code": 0, "stdout": "hi\n", "stderr": ""})

        async with FakeServer(h) as srv:
            c = client_for(srv)
            real_open = c._pool._open
            fails = 2

            async def flaky_open():
                nonlocal fails
                if fails:
                    fails -= 1
                    raise _http.ConnectError("connecting: refused")
                return await real_open()

            c._pool._open = flaky_open  # type: ignore[method-assign]
            res = await c.sandbox("sb-e-1").run_shell("echo hi")
            await c.close()
        self.assertEqual(res.stdout, "hi\n")
        self.assertEqual(len(srv.requests), 1, "the request itself was sent once")

    async def test_deadline(self):
        async def h(req: Request):
            await asyncio.sleep(1)
            return json_reply(200, {})

        async with FakeServer(h) as srv:
            c = client_for(srv)
            with self.assertRaises(libdsec.DeadlineExceeded) as cm:
                await c._call("GET", "/v1/nodes", timeout=0.1)
            self.assertIsInstance(cm.exception, TimeoutError)
            self.assertEqual(c._pool.in_use, 0, "a timed-out call gives its connection back")
            await c.close()

    async def test_unreachable_endpoint(self):
        c = libdsec.DSecClient("http://127.0.0.1:1", "k", max_retries=1, backoff_base=0.001)
        with self.assertRaises(libdsec.ConnectionFailed) as cm:
            await c.open()
        self.assertIn("127.0.0.1:1", str(cm.exception))
        await c.close()


if __name__ == "__main__":
    unittest.main()
