"""Unit tests of the IAM calls (projects, keys, whoami, audit) against the
fake server: what is sent, how answers and errors are read."""

from __future__ import annotations

import asyncio
import threading
import unittest
from datetime import datetime, timedelta, timezone

from fakeserver import AsyncTest, FakeServer, Reply, Request, error_reply, json_reply
from test_api import Router, sandbox_doc

import libdsec
import libdsec.sync


def project_doc(pid: str = "team-a", **kw) -> dict:
    d = {
        "id": pid,
        "name": pid,
        "parent": "root",
        "path": "root/" + pid,
        "quota": {"sandboxes": 10, "cpu": 8, "memory_mb": 16384, "disk_mb": 0},
        "usage": {"sandboxes": 3, "cpu": 1.5, "memory_mb": 2048, "disk_mb": 512},
        "children": ["job-7"],
        "dedicated_nodes": False,
        "created_at": "2026-05-01T00:00:00Z",
    }
    d.update(kw)
    return d


class ProjectsTest(AsyncTest):
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
        return [(q.method, q.target) for q in self.srv.requests]

    async def test_create_project(self):
        self.r.on("POST", "/v1/projects", lambda q: json_reply(201, project_doc(q.json()["name"], parent=q.json()["parent"], quota=q.json()["quota"])))
        p = await self.c.create_project(
            "job-7", parent="team-a", quota=libdsec.ProjectQuota(sandboxes=4, cpu=2.5, memory_mb=4096, disk_mb=1024), dedicated_nodes=True
        )
        self.assertEqual((p.id, p.parent, p.quota), ("job-7", "team-a", libdsec.ProjectQuota(4, 2.5, 4096, 1024)))
        self.assertEqual((p.usage.sandboxes, p.usage.cpu, p.children), (3, 1.5, ["job-7"]))
        req = self.srv.requests[0]
        self.assertEqual(
            req.json(),
            {"parent": "team-a", "name": "job-7", "quota": {"sandboxes": 4, "cpu": 2.5, "memory_mb": 4096, "disk_mb": 1024}, "dedicated_nodes": True},
        )
        self.assertEqual(req.headers["authorization"], "Bearer key-1")
        # No Idempotency-Key: the server would keep the answer.
        self.assertNotIn("idempotency-key", req.headers)
        await self.c.create_project("j", parent="root")
        self.assertEqual(self.srv.requests[1].json(), {"parent": "root", "name": "j", "quota": {"sandboxes": 0, "cpu": 0.0, "memory_mb": 0, "disk_mb": 0}})

        # Bad input is refused before any call.
        n = len(self.srv.requests)
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.create_project("", parent="root")
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.create_project("x", parent="")
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.create_project("x", parent="root", quota=libdsec.ProjectQuota(sandboxes=-1))
        with self.assertRaises(TypeError):
            await self.c.create_project("x", parent="root", quota=libdsec.ProjectQuota(cpu="2"))  # type: ignore[arg-type]
        self.assertEqual(len(self.srv.requests), n)

    async def test_create_not_resent(self):
        # A create that reached the server is not sent again after a
        # gateway error: without a key, a repeat could run twice.
        self.r.on("POST", "/v1/projects", Reply(502, body=b"<html>bad gateway</html>"))
        with self.assertRaises(libdsec.Unavailable):
            await self.c.create_project("x", parent="root")
        self.assertEqual(len(self.srv.requests), 1)

    async def test_get_update_delete(self):
        self.r.on("GET", "/v1/projects/team%20a%2Fb", json_reply(200, project_doc("team a/b")))
        self.r.on("PATCH", "/v1/projects/team-a", lambda q: json_reply(200, project_doc(**q.json())))
        self.r.on("DELETE", "/v1/projects/team-a", Reply(204))
        p = await self.c.get_project("team a/b")
        self.assertEqual((p.id, p.path, p.usage.disk_mb, p.raw["name"]), ("team a/b", "root/team a/b", 512, "team a/b"))

        p = await self.c.update_project("team-a", dedicated_nodes=False)
        self.assertEqual(self.srv.requests[-1].json(), {"dedicated_nodes": False})
        q = (await self.c.get_project("team a/b")).quota
        q.sandboxes = 20
        p = await self.c.update_project("team-a", quota=q)
        self.assertEqual(self.srv.requests[-1].json(), {"quota": {"sandboxes": 20, "cpu": 8.0, "memory_mb": 16384, "disk_mb": 0}})
        self.assertEqual(p.quota.sandboxes, 20)
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.update_project("team-a")

        await self.c.delete_project("team-a")
        await self.c.delete_project("team-a", cascade=True)
        self.assertEqual(self.calls()[-2:], [("DELETE", "/v1/projects/team-a"), ("DELETE", "/v1/projects/team-a?cascade=true")])
        n = len(self.srv.requests)
        for call in (self.c.get_project(""), self.c.delete_project(""), self.c.revoke_key("p", ""), self.c.list_keys("")):
            with self.assertRaises(libdsec.InvalidArgument):
                await call
        self.assertEqual(len(self.srv.requests), n)

    async def test_list_projects_pages(self):
        def lst(q: Request):
            tok = (q.query.get("page_token") or [""])[0]
            if q.query.get("parent") == ["loop"]:
                return json_reply(200, {"projects": [], "next_page_token": "same"})
            if tok == "":
                return json_reply(200, {"projects": [project_doc("a"), project_doc("b")], "next_page_token": "t2"})
            return json_reply(200, {"projects": [project_doc("c")]})

        self.r.on("GET", "/v1/projects", lst)
        ps = await self.c.list_projects("team-a", page_size=2)
        self.assertEqual([p.id for p in ps], ["a", "b", "c"])
        self.assertEqual(
            [q.query for q in self.srv.requests],
            [{"parent": ["team-a"], "limit": ["2"]}, {"parent": ["team-a"], "limit": ["2"], "page_token": ["t2"]}],
        )
        await self.c.list_projects()
        self.assertEqual(self.srv.requests[2].query, {})
        with self.assertRaises(libdsec.ProtocolError):
            await self.c.list_projects("loop")

    async def test_keys(self):
        def create(q: Request):
            b = q.json()
            return json_reply(201, {"id": "k-2", "key": "dsec_SECRET", "project": "team-a", "role": b["role"], "name": b.get("name", ""), "created_at": "t"})

        self.r.on("POST", "/v1/projects/team-a/keys", create)
        self.r.on("GET", "/v1/projects/team-a/keys", json_reply(200, {"keys": [{"id": "k-1", "role": "builder", "project": "team-a", "expires_at": "2030-01-01T00:00:00Z"}, {"id": "k-2", "role": "viewer"}]}))
        self.r.on("DELETE", "/v1/projects/team-a/keys/k%2F1", Reply(204))
        k = await self.c.create_key("team-a", "builder", name="ci", expires_in=90.5)
        self.assertEqual((k.id, k.key, k.role, k.name), ("k-2", "dsec_SECRET", "builder", "ci"))
        self.assertNotIn("SECRET", repr(k))  # a logged key does not leak its secret
        req = self.srv.requests[0]
        self.assertEqual(req.json(), {"role": "builder", "name": "ci", "expires_in": 91})
        self.assertNotIn("idempotency-key", req.headers)
        await self.c.create_key("team-a", "viewer")
        self.assertEqual(self.srv.requests[1].json(), {"role": "viewer"})
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.create_key("team-a", "")
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.create_key("team-a", "member", expires_in=-1)

        keys = await self.c.list_keys("team-a")
        self.assertEqual([(k.id, k.expires_at, k.key) for k in keys], [("k-1", "2030-01-01T00:00:00Z", ""), ("k-2", "", "")])
        await self.c.revoke_key("team-a", "k/1")
        self.assertEqual(self.calls()[-1], ("DELETE", "/v1/projects/team-a/keys/k%2F1"))

    async def test_whoami_and_audit(self):
        self.r.on("GET", "/v1/whoami", json_reply(200, {"principal": "k-1", "project": "team-a", "role": "member", "permissions": ["sandbox:write"]}))
        entry = {"time": "2026-05-01T08:00:00Z", "principal": "k-1", "project": "team-a", "action": "key.create", "target": "k-2", "detail": "role builder"}
        self.r.on("GET", "/v1/audit", json_reply(200, {"entries": [entry]}))
        who = await self.c.whoami()
        self.assertEqual(who, libdsec.WhoAmI("k-1", "team-a", "member", ["sandbox:write"]))

        since = datetime(2026, 5, 1, 10, 0, 0, 700000, tzinfo=timezone(timedelta(hours=2)))
        es = await self.c.list_audit(since, limit=20)
        self.assertEqual(es, [libdsec.AuditEntry(**entry)])
        # UTC, whole seconds rounded down; ':' is escaped in the query.
        self.assertEqual(self.srv.requests[-1].target, "/v1/audit?since=2026-05-01T08%3A00%3A00Z&limit=20")
        await self.c.list_audit("2026-04-30T00:00:00Z")
        self.assertEqual(self.srv.requests[-1].query, {"since": ["2026-04-30T00:00:00Z"]})
        await self.c.list_audit()
        self.assertEqual(self.srv.requests[-1].query, {})
        with self.assertRaises(libdsec.InvalidArgument):
            await self.c.list_audit(limit=-1)

    async def test_errors(self):
        self.r.on("POST", "/v1/projects", error_reply(429, "quota_exceeded", "project root/team-a: sandboxes 20 > 10"))
        self.r.on("GET", "/v1/projects/nope", error_reply(404, "not_found", "project nope not found"))
        self.r.on("POST", "/v1/projects/team-a/keys", error_reply(403, "permission_denied", "role member may not grant admin"))
        self.r.on("GET", "/v1/whoami", Reply(429, body=b"slow down"))
        with self.assertRaises(libdsec.QuotaExceeded) as cm:
            await self.c.create_project("big", parent="team-a", quota=libdsec.ProjectQuota(sandboxes=20))
        self.assertEqual((cm.exception.code, cm.exception.status), ("quota_exceeded", 429))
        self.assertIn("sandboxes 20 > 10", cm.exception.message)
        with self.assertRaises(libdsec.NotFound) as nf:
            await self.c.get_project("nope")
        self.assertNotIsInstance(nf.exception, libdsec.SandboxNotFound)
        with self.assertRaises(libdsec.PermissionDenied):
            await self.c.create_key("team-a", "admin")
        with self.assertRaises(libdsec.QuotaExceeded):  # a bare 429 is classified by its status
            await self.c.whoami()

    async def test_sandbox_project(self):
        self.r.on("POST", "/v1/sandboxes", lambda q: json_reply(201, sandbox_doc(project=q.json()["project"])))
        sb = await self.c.run_container(libdsec.DSecContainerRunArgs(container_image="b/x:1", project="job-7"))
        self.assertEqual(sb.info.project, "job-7")
        self.assertEqual(self.srv.requests[0].json(), {"base": "b/x:1", "project": "job-7"})


class SyncProjectsTest(unittest.TestCase):
    def test_sync_facade(self):
        r = Router()
        r.on("GET", "/healthz", json_reply(200, {"status": "ok"}))
        r.on("GET", "/v1/whoami", json_reply(200, {"principal": "k-1", "project": "root", "role": "admin"}))
        r.on("GET", "/v1/projects", json_reply(200, {"projects": [project_doc()]}))
        ready = threading.Event()
        box: list = []

        def serve():
            async def main():
                async with FakeServer(r) as srv:
                    box.append((asyncio.get_running_loop(), asyncio.Event(), srv))
                    ready.set()
                    await box[0][1].wait()

            asyncio.run(main())

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        ready.wait(5)
        loop, ev, srv = box[0]
        try:
            with libdsec.sync.DSecClient(srv.endpoint, "k") as c:
                self.assertEqual(c.whoami().role, "admin")
                self.assertEqual([p.id for p in c.list_projects()], ["team-a"])
        finally:
            loop.call_soon_threadsafe(ev.set)
            t.join(5)


if __name__ == "__main__":
    unittest.main()
