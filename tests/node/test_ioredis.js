// test_ioredis.js: idemd with ioredis (connect and ready check, CLIENT SETINFO on connect,
// claims new/busy/done/mismatch/recover, exact expiry of finished records only (rule 5),
// commit, done with the stored result, owner-call
// errors as ReplyError, SET NX PX/GET, a pipeline (replies in order), auto-pipelining, WAIT
// woken by a commit, custom commands via redis.call('IDEM.CLAIM', ...) and callBuffer).
// Needs IDEMD_PORT (TCP, role worker) and IDEMD_SOCK (unix socket, role admin, --test-clock);
// tests/scripts/test_node.sh starts idemd and runs this. Prints `N passed, M failed` last.
'use strict';

const assert = require('node:assert/strict');
const Redis = require('ioredis');

const port = Number(process.env.IDEMD_PORT);
const sock = process.env.IDEMD_SOCK;
const DAY = 86400000;
let passed = 0;
let failed = 0;
const tests = [];
const test = (name, fn) => tests.push({ name, fn });
const clients = [];
const worker = (opts = {}) => {
  const c = new Redis({ host: '127.0.0.1', port, lazyConnect: false, maxRetriesPerRequest: 0, ...opts });
  clients.push(c);
  return c;
};
const admin = () => {
  const c = new Redis({ path: sock, maxRetriesPerRequest: 0 });
  clients.push(c);
  return c;
};
const rejects = async (p, re) => {
  try {
    await p;
  } catch (e) {
    assert.match(String(e.message), re);
    return e;
  }
  throw new Error(`expected an error matching ${re}`);
};

let w, a;

test('connects and passes the ready check (INFO loading:0)', async () => {
  w = worker();
  a = admin();
  await Promise.all([w.ping(), a.ping()]);
  assert.equal(w.status, 'ready');
  assert.equal(await w.ping(), 'PONG');
  assert.equal(await w.echo('hi'), 'hi');
});

test('claim new, busy, commit, done with result (redis.call)', async () => {
  const r = await w.call('IDEM.CLAIM', 'node:order:1', DAY, 30000, 'FP', '{"amount":100}');
  assert.equal(r.length, 2);
  assert.equal(r[0], 'new');
  assert.equal(typeof r[1], 'number');
  const tok = r[1];
  assert.deepEqual(await w.call('IDEM.CLAIM', 'node:order:1', DAY, 30000, 'FP', '{"amount":100}'), ['busy', 30000]);
  assert.equal(await w.call('IDEM.COMMIT', 'node:order:1', tok, 'inv_9f2'), 'OK');
  assert.equal(await w.call('IDEM.COMMIT', 'node:order:1', tok, 'inv_9f2'), 'OK');
  await rejects(w.call('IDEM.COMMIT', 'node:order:1', tok, 'inv_other'), /^CONFLICT/);
  assert.deepEqual(await w.call('IDEM.CLAIM', 'node:order:1', DAY, 30000, 'FP', '{"amount":100}'), ['done', 'inv_9f2']);
  assert.deepEqual(await w.call('IDEM.CLAIM', 'node:order:1', DAY, 30000, 'FP', '{"amount":7}'), ['mismatch']);
  assert.equal(await w.get('node:order:1'), 'inv_9f2');
});

test('owner calls: STALE, NOTFOUND as ReplyError; release then new', async () => {
  const [, tok] = await w.call('IDEM.CLAIM', 'node:rel', DAY, 30000);
  const e = await rejects(w.call('IDEM.COMMIT', 'node:rel', tok + 1000, 'x'), /^STALE/);
  assert.equal(e.name, 'ReplyError');
  assert.equal(await w.call('IDEM.RELEASE', 'node:rel', tok), 'OK');
  await rejects(w.call('IDEM.RELEASE', 'node:rel', tok), /^NOTFOUND/);
  const [outcome, tok2] = await w.call('IDEM.CLAIM', 'node:rel', DAY, 30000);
  assert.equal(outcome, 'new');
  assert.ok(tok2 > tok);
});

test('binary result and key with callBuffer', async () => {
  const key = Buffer.from([0x6e, 0x00, 0xff, 0x0d, 0x0a]);
  const [outcome, tok] = await w.call('IDEM.CLAIM', key, DAY, 30000);
  assert.equal(outcome, 'new');
  const result = Buffer.from([0, 1, 2, 0xff, 13, 10]);
  assert.equal(await w.call('IDEM.COMMIT', key, tok, result), 'OK');
  const r = await w.callBuffer('IDEM.CLAIM', key, DAY, 30000);
  assert.ok(Buffer.isBuffer(r[0]));
  assert.equal(r[0].toString(), 'done');
  assert.ok(r[1].equals(result));
});

test('recover after the lease runs out (DEBUG CLOCK on the admin socket)', async () => {
  const g = await a.call('DEBUG', 'CLOCK', 'GET');
  const [, tok] = await w.call('IDEM.CLAIM', 'node:rec', DAY, 1000);
  await a.call('DEBUG', 'CLOCK', 'ADVANCE', 1000);
  const r = await w.call('IDEM.CLAIM', 'node:rec', DAY, 1000);
  assert.equal(r[0], 'recover');
  assert.ok(r[1] > tok);
  assert.deepEqual(r.slice(2), [2, g]);
  await rejects(w.call('IDEM.COMMIT', 'node:rec', tok, 'x'), /^STALE/);
  assert.equal(await w.call('IDEM.COMMIT', 'node:rec', r[1], 'looked-up'), 'OK');
});

test('expiry is exact and only finished records expire (rule 5)', async () => {
  const t0 = await a.call('DEBUG', 'CLOCK', 'GET');
  const [, tok] = await w.call('IDEM.CLAIM', 'node:exp', 1000, 30000);
  assert.equal(await w.call('IDEM.COMMIT', 'node:exp', tok, 'r'), 'OK');
  const [, open] = await w.call('IDEM.CLAIM', 'node:exp-open', 1000, 7 * DAY);
  await a.call('DEBUG', 'CLOCK', 'ADVANCE', 999); // expires_at - 1: a repeat
  assert.deepEqual(await w.call('IDEM.CLAIM', 'node:exp', 1000, 30000), ['done', 'r']);
  assert.equal(await w.pttl('node:exp'), 1);
  await a.call('DEBUG', 'CLOCK', 'ADVANCE', 1); // expires_at: absent, a re-issue is new
  assert.equal(await w.exists('node:exp'), 0);
  const [out, tok2] = await w.call('IDEM.CLAIM', 'node:exp', 1000, 30000);
  assert.equal(out, 'new');
  assert.ok(tok2 > tok);
  // An in_flight record past its expiry stays; committed then, it keeps its outcome a ttl more.
  assert.equal((await w.call('IDEM.CLAIM', 'node:exp-open', 1000, 30000))[0], 'busy');
  assert.equal(await w.call('IDEM.COMMIT', 'node:exp-open', open, 'late'), 'OK');
  const flat = await w.call('IDEM.GET', 'node:exp-open');
  assert.equal(flat[flat.indexOf('expires_at_ms') + 1], String(t0 + 1000 + 1000));
});

test('hold then review', async () => {
  const [, tok] = await w.call('IDEM.CLAIM', 'node:hold', DAY, 30000);
  assert.equal(await w.call('IDEM.HOLD', 'node:hold', tok, 'unsure'), 'OK');
  assert.deepEqual(await w.call('IDEM.CLAIM', 'node:hold', DAY, 30000), ['review', 'unsure']);
});

test('IDEM.GET as a flat array', async () => {
  const flat = await w.call('IDEM.GET', 'node:order:1');
  const rec = {};
  for (let i = 0; i < flat.length; i += 2) rec[flat[i]] = flat[i + 1];
  assert.equal(rec.state, 'committed');
  assert.equal(rec.result, 'inv_9f2');
  assert.equal(rec.mismatch_count, '1');
  assert.match(rec.fingerprint, /^[0-9a-f]{32}$/);
  assert.equal(await w.call('IDEM.GET', 'node:absent'), null);
});

test('SET NX PX / EX / GET, and the shared keyspace', async () => {
  assert.equal(await w.set('node:s1', 'v1', 'PX', 10000, 'NX'), 'OK');
  assert.equal(await w.set('node:s1', 'v2', 'PX', 10000, 'NX'), null);
  assert.equal(await w.set('node:s1', 'v3', 'NX', 'EX', 10, 'GET'), 'v1');
  assert.equal(await w.set('node:s2', 'w', 'NX', 'EX', 10, 'GET'), null);
  assert.equal(await w.get('node:s1'), 'v1');
  assert.equal(await w.pttl('node:s1'), 10000);
  assert.equal(await w.ttl('node:s2'), 10);
  assert.equal(await w.exists('node:s1', 'node:s2', 'node:none'), 2);
  assert.deepEqual(await w.call('IDEM.CLAIM', 'node:s1', DAY, 1000), ['done', 'v1']);
  await rejects(w.set('node:s1', 'v'), /SET without NX is refused/);
  await rejects(w.expire('node:s1', 100), /EXPIRE is refused/);
  await rejects(w.dbsize(), /^NOPERM/);
  assert.ok((await a.dbsize()) >= 7); // other tests' keys too: at least this test's 7
});

test('a pipeline: replies in order, errors in place', async () => {
  const p = w.pipeline();
  for (let i = 0; i < 40; i++) {
    p.call('IDEM.CLAIM', `node:pipe:${i}`, DAY, 30000);
    p.echo(`e${i}`);
  }
  p.call('IDEM.CLAIM', 'node:pipe:0', DAY, 30000);
  p.call('NOSUCHCOMMAND');
  p.ping();
  const res = await p.exec();
  assert.equal(res.length, 83);
  const toks = [];
  for (let i = 0; i < 40; i++) {
    assert.equal(res[2 * i][0], null);
    assert.equal(res[2 * i][1][0], 'new');
    toks.push(res[2 * i][1][1]);
    assert.deepEqual(res[2 * i + 1], [null, `e${i}`]);
  }
  for (let i = 1; i < toks.length; i++) assert.ok(toks[i] > toks[i - 1], 'tokens increase in request order');
  assert.equal(res[80][1][0], 'busy');
  assert.match(String(res[81][0]), /unknown command/);
  assert.deepEqual(res[82], [null, 'PONG']);
  const c = w.pipeline();
  toks.forEach((t, i) => c.call('IDEM.COMMIT', `node:pipe:${i}`, t, `r${i}`).get(`node:pipe:${i}`));
  const out = await c.exec();
  toks.forEach((t, i) => {
    assert.deepEqual(out[2 * i], [null, 'OK']);
    assert.deepEqual(out[2 * i + 1], [null, `r${i}`]);
  });
});

test('auto-pipelining: 200 concurrent claims on one connection', async () => {
  const ap = worker({ enableAutoPipelining: true });
  const rs = await Promise.all(Array.from({ length: 200 }, (_, i) => ap.call('IDEM.CLAIM', `node:ap:${i % 50}`, DAY, 30000)));
  const news = rs.filter((r) => r[0] === 'new').length;
  const busy = rs.filter((r) => r[0] === 'busy').length;
  assert.equal(news, 50);
  assert.equal(busy, 150);
});

test('WAIT woken by a commit on another connection', async () => {
  const [, tok] = await w.call('IDEM.CLAIM', 'node:wait', DAY, 30000);
  const other = worker();
  const t0 = Date.now();
  const waiting = other.call('IDEM.CLAIM', 'node:wait', DAY, 30000, 'WAIT', 20000);
  // Parked once it counts as a repeat: a sleep let a slow waiter come after the commit.
  for (let i = 0; ; i++) {
    const rec = await w.call('IDEM.GET', 'node:wait');
    if (Number(rec[rec.indexOf('seen_count') + 1]) >= 2) break;
    assert.ok(i < 1000, 'the waiter did not park');
    await new Promise((r) => setTimeout(r, 10));
  }
  assert.equal(await w.call('IDEM.COMMIT', 'node:wait', tok, 'after-wait'), 'OK');
  assert.deepEqual(await waiting, ['done', 'after-wait']);
  assert.ok(Date.now() - t0 < 10000);
});

test('HELLO 3 answers NOPROTO; CLIENT SETNAME/GETNAME; SELECT 0', async () => {
  await rejects(w.call('HELLO', 3), /^NOPROTO/);
  assert.equal(await w.client('SETNAME', 'node-worker'), 'OK');
  assert.equal(await w.client('GETNAME'), 'node-worker');
  // ioredis sends SETINFO on connect and ignores its answer: asked here, it must be OK.
  assert.equal(await w.client('SETINFO', 'LIB-NAME', 'ioredis'), 'OK');
  assert.equal(await w.select(0), 'OK');
  const c = worker({ db: 0, connectionName: 'named' });
  assert.equal(await c.client('GETNAME'), 'named');
});

test('bad input keeps the connection usable', async () => {
  const id = await w.client('ID');
  await rejects(w.call('IDEM.CLAIM', 'k'.repeat(513), DAY, 1000), /too long/);
  await rejects(w.call('IDEM.CLAIM', 'node:bad', 0, 1000), /ttl_ms/);
  await rejects(w.call('IDEM.CLAIM', 'node:bad'), /wrong number of arguments/);
  await rejects(w.call('NOSUCH'), /unknown command/);
  assert.equal(await w.client('ID'), id);
});

(async () => {
  const timer = setTimeout(() => {
    console.log('timed out');
    console.log(`${passed} passed, ${failed + 1} failed`);
    process.exit(1);
  }, 120000);
  for (const t of tests) {
    try {
      await t.fn();
      passed++;
      console.log(`ok   ${t.name}`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${t.name}\n     ${e && e.stack ? e.stack.split('\n').slice(0, 4).join('\n     ') : e}`);
    }
  }
  clearTimeout(timer);
  await Promise.all(clients.map((c) => c.quit().catch(() => c.disconnect())));
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed === 0 && passed > 0 ? 0 : 1);
})();
