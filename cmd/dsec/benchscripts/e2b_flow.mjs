// The node side of `dsec bench e2b`: one long-lived node process, so that
// node's start-up and the SDK's loading are not counted. For each line
// "flow" on stdin it runs Sandbox.create → commands.run('echo hi') →
// kill through the E2B SDK; for each line "rest", the native flow
// (create → exec → delete on dsec's /v1 API) through node's own fetch,
// so that the two differ by their path and not by the runtime. Each
// answer is one JSON line of the flow's timings in milliseconds (or
// {"error": "..."}). It reads E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY from the environment, as any E2B code does; the native flow
// uses the same endpoint and key. Arguments: TEMPLATE LABEL (LABEL goes
// in the metadata and labels, so that the bench can delete what a failed
// flow left behind).
import { Sandbox } from 'e2b'
import { createInterface } from 'node:readline'
import { performance } from 'node:perf_hooks'

const [template, label] = process.argv.slice(2)
const say = (o) => process.stdout.write(JSON.stringify(o) + '\n')

// describe says what went wrong in a line or two: the SDK's errors carry
// their detail in fields (a command's exit code and stderr), not in the
// stack.
function describe(step, e) {
  if (!(e instanceof Error)) return `${step}: ${String(e)}`
  let s = `${step}: ${e.name}${e.message ? ": " + e.message : ""}`
  if (e.exitCode !== undefined) s += ` (exit ${e.exitCode}, stderr ${JSON.stringify(e.stderr)})`
  return s
}

async function step(name, fn) {
  try {
    return await fn()
  } catch (e) {
    throw new Error(describe(name, e))
  }
}

async function flow() {
  const t0 = performance.now()
  const sandbox = await step('Sandbox.create', () => Sandbox.create(template, { metadata: { bench: label } }))
  const t1 = performance.now()
  let res
  try {
    res = await step('commands.run', () => sandbox.commands.run('echo hi'))
    if (res.exitCode !== 0 || res.stdout !== 'hi\n') {
      throw new Error(`commands.run: echo hi: exit ${res.exitCode}, stdout ${JSON.stringify(res.stdout)}, stderr ${JSON.stringify(res.stderr)}`)
    }
  } catch (e) {
    await sandbox.kill().catch(() => {})
    throw e
  }
  const t2 = performance.now()
  const killed = await step('kill', () => sandbox.kill())
  const t3 = performance.now()
  if (!killed) throw new Error(`kill: sandbox ${sandbox.sandboxId} not found`)
  return { create_ms: t1 - t0, run_ms: t2 - t1, kill_ms: t3 - t2, flow_ms: t3 - t0 }
}

// rest is the native flow from node: dsec's REST API through fetch, with
// what commands.run sends as the command.
const api = (process.env.E2B_API_URL || '').replace(/\/+$/, '')
const auth = { Authorization: `Bearer ${process.env.E2B_API_KEY}` }

async function call(step, method, path, body, want) {
  const init = { method, headers: { ...auth } }
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json'
    init.body = JSON.stringify(body)
  }
  let res, text
  try {
    res = await fetch(api + path, init)
    text = await res.text()
  } catch (e) {
    throw new Error(describe(step, e))
  }
  if (res.status !== want) throw new Error(`${step}: HTTP ${res.status}: ${text.slice(0, 300)}`)
  return text === '' ? null : JSON.parse(text)
}

async function rest() {
  const t0 = performance.now()
  const sb = await call('create', 'POST', '/v1/sandboxes', { base: template, labels: { bench: label } }, 201)
  const t1 = performance.now()
  try {
    const res = await call('exec', 'POST', `/v1/sandboxes/${sb.id}/exec`, { argv: ['/bin/bash', '-l', '-c', 'echo hi'] }, 200)
    if (res.exit_code !== 0 || res.stdout !== 'hi\n') {
      throw new Error(`exec: echo hi: exit ${res.exit_code}, stdout ${JSON.stringify(res.stdout)}, stderr ${JSON.stringify(res.stderr)}`)
    }
  } catch (e) {
    await call('delete', 'DELETE', `/v1/sandboxes/${sb.id}`, undefined, 204).catch(() => {})
    throw e
  }
  const t2 = performance.now()
  await call('delete', 'DELETE', `/v1/sandboxes/${sb.id}`, undefined, 204)
  const t3 = performance.now()
  return { create_ms: t1 - t0, run_ms: t2 - t1, kill_ms: t3 - t2, flow_ms: t3 - t0 }
}

const commands = { flow, rest }
say({ ready: true, version: process.version })
for await (const line of createInterface({ input: process.stdin })) {
  const run = commands[line.trim()]
  if (!run) {
    say({ error: `unknown command ${JSON.stringify(line)}` })
    continue
  }
  try {
    say(await run())
  } catch (e) {
    say({ error: e instanceof Error ? e.message : String(e) })
  }
}
