"""The tensor weight sync's shared-memory transport (issue #14): handles, not bytes, in SGLang's payload.

Independent references: the trainer's tensors (bitwise, for the served parameters), an independent
transformers forward of the same weights (log-probs of a real server process), the files in
/dev/shm (counted and sized by os.listdir / os.stat, not by moerl), and hand-built pickles naming
globals the restricted unpickler must refuse.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from moerl.rollout.server import ReferenceEngine, create_app, load_safetensors_dir  # noqa: E402
from moerl.rollout.tensor_serde import (  # noqa: E402
    SHM_DIR, deserialize, named_tensors_from_payload, serialize_shared)
from moerl.rollout.weight_sync import (  # noqa: E402
    SharedBucketBuffers, WeightSyncError, sync_weights_from_tensor, tensor_transports)

sys.path.insert(0, os.path.dirname(__file__))
from _mp_helpers import free_port_block  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _my_shm_files() -> dict[str, int]:
    """/dev/shm files torch made for this process (torch_<pid>_*) and their sizes in bytes."""
    out = {}
    for f in os.listdir(SHM_DIR):
        if f.startswith(f"torch_{os.getpid()}_"):
            try:
                out[f] = os.stat(os.path.join(SHM_DIR, f)).st_size
            except FileNotFoundError:
                pass
    return out


def _evil(func, *args) -> bytes:
    class R:
        def __reduce__(self):
            return func, args

    return pickle.dumps([("x", R())], protocol=pickle.HIGHEST_PROTOCOL)


def test_transport_is_decided_by_address():
    urls = ["http://127.0.0.1:30000", "http://localhost:1", "http://[::1]:2", "http://10.255.255.77:3",
            "http://testserver"]
    assert tensor_transports(urls) == {urls[0]: "shm", urls[1]: "shm", urls[2]: "shm", urls[3]: "bytes",
                                       urls[4]: "bytes"}
    assert set(tensor_transports(urls, "bytes").values()) == {"bytes"}
    assert set(tensor_transports(urls, "shm").values()) == {"shm"}
    with pytest.raises(ValueError, match="tensor transport"):
        tensor_transports(urls, "ipc")


def test_payload_holds_handles_not_bytes():
    """4 MiB of tensors travel in a payload of well under 1 KiB, and moerl's restricted unpickler
    rebuilds them as views of the same shared storage (another process reading such payloads:
    test_repeated_syncs_to_a_server_process..., and tests/test_weight_sync.py's two-server test)."""
    bufs = SharedBucketBuffers()
    buf = bufs.buffer(0, 4 << 20)
    g = torch.Generator().manual_seed(3)
    want = {"a": torch.randn(512, 1024, generator=g), "b": torch.randint(-9, 9, (7, 3), generator=g).to(torch.bfloat16)}
    a = buf[:512 * 1024 * 4].view(torch.float32).view(512, 1024)
    b = buf[2 << 20:(2 << 20) + 42].view(torch.bfloat16).view(7, 3)
    a.copy_(want["a"])
    b.copy_(want["b"])
    blob = serialize_shared([("a", a), ("b", b)])
    assert len(blob) < 1024
    got = dict(named_tensors_from_payload(deserialize(blob)))
    assert torch.equal(got["a"], want["a"]) and torch.equal(got["b"], want["b"]) and got["b"].dtype == torch.bfloat16
    assert got["a"].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # mapped, not copied


def test_restricted_unpickler_refuses_other_globals_and_bad_handles():
    import torch.multiprocessing.reductions as red

    for func, args in [(os.system, ("true",)), (eval, ("1",)), (getattr, (torch.Tensor, "fill_")),
                       (subprocess.Popen, (["true"],)), (torch.load, ("x",))]:
        with pytest.raises(ValueError, match="does not unpickle"):
            deserialize(_evil(func, *args))
    with pytest.raises(ValueError, match="file_descriptor"):
        deserialize(_evil(red.rebuild_storage_fd, torch.UntypedStorage, 3, 10))
    keep = SharedBucketBuffers().buffer(0, 1 << 20)  # alive while its handle is used
    good = serialize_shared([("t", keep[:16])])
    manager, handle = None, None
    for op, arg, _ in __import__("pickletools").genops(base64.b64decode(good)):
        if isinstance(arg, bytes) and arg.endswith(b"manager.sock"):
            manager = arg
        elif isinstance(arg, bytes) and arg.startswith(b"/torch_"):
            handle = arg
    assert manager is not None and handle is not None
    deserialize(good)  # balances the reference the payload carries
    size = os.stat(SHM_DIR + handle.decode()).st_size
    for args, msg in [((torch.UntypedStorage, manager, b"/../../etc/passwd", 10), "not a torch /dev/shm name"),
                      ((torch.UntypedStorage, b"/tmp/evil.sock", handle, 10), "not a torch_shm_manager socket"),
                      ((torch.UntypedStorage, manager, handle, size + 1), "claims"),
                      ((torch.UntypedStorage, manager, b"/torch_1_2_999999", 10), "does not exist on this host"),
                      ((torch.nn.Parameter, manager, handle, 10), "UntypedStorage")]:
        with pytest.raises(ValueError, match=msg):
            deserialize(_evil(red.rebuild_storage_filename, *args))


def test_shm_sync_into_the_in_process_server_is_bitwise(ckpts):
    """transport shm forced into an in-process server: the served parameters equal the trainer's."""
    sd = dict(load_safetensors_dir(ckpts[1]))
    engine = ReferenceEngine(ckpts[0])
    client = TestClient(create_app(engine))
    try:
        bufs = SharedBucketBuffers()
        n = sync_weights_from_tensor([str(client.base_url)], sd, "s1", bucket_bytes=30_000, http_client=client,
                                     transport="shm", buffers=bufs)
        assert n > 2 and bufs.nbytes == 2 << 20
        assert [k for k, t in sd.items() if not torch.equal(engine.mapper.resolve(k, t)[0], t)] == []
        assert client.get("/get_model_info").json()["weight_version"] == "s1"
        with pytest.raises(WeightSyncError, match="matches no parameter"):
            sync_weights_from_tensor([str(client.base_url)], {"bogus.weight": torch.ones(2)}, "s2",
                                     http_client=client, transport="shm", buffers=bufs)
    finally:
        engine.close()


def _logprobs(c: httpx.Client) -> torch.Tensor:
    r = c.post("/generate", json={"input_ids": [4, 5, 13, 6], "return_logprob": True, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])


@pytest.mark.slow
def test_repeated_syncs_to_a_server_process_reuse_the_same_shm_files(ckpts, ref_models, tmp_path):
    """A real server process on 127.0.0.1: 6 syncs (alternating two weight sets, several buckets)
    use the same two /dev/shm files; the served log-probs equal transformers' forward of the weights
    sent last; after the trainer drops its buffers, the old files are unlinked at the end of the second
    sync that does not use them (the server keeps the last two syncs' mappings: the export arena
    alternates two slots)."""
    sds = [dict(load_safetensors_dir(p)) for p in ckpts]
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    log = str(tmp_path / "s.log")
    proc = subprocess.Popen([sys.executable, "-m", "moerl.rollout.server", "--model-path", ckpts[0], "--port",
                             str(port), "--num-threads", "1", "--log-file", log],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    bufs = SharedBucketBuffers()
    try:
        from moerl.rollout.launcher import wait_healthy

        wait_healthy(url, proc, timeout_s=120.0, what="server", log_path=log)
        before = _my_shm_files()
        seen = []
        for k in range(6):
            sync_weights_from_tensor([url], sds[(k + 1) % 2], f"v{k}", bucket_bytes=40_000, buffers=bufs)
            seen.append({f: s for f, s in _my_shm_files().items() if f not in before})
        assert len(seen[0]) == 2 and all(s == seen[0] for s in seen), seen  # same 2 files, same sizes
        assert all(bufs.nbytes // 2 <= s <= bufs.nbytes // 2 + 4096 for s in seen[0].values())  # + torch's header
        ref = ref_models[0]  # v5 sent sds[0]
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            ids, lps = _logprobs(c)
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([[4, 5, 13, 6] + ids])).logits[0].float()
        want = torch.log_softmax(logits[3:3 + len(ids)], -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        torch.testing.assert_close(lps, want, atol=1e-4, rtol=0)
        bufs.release()
        sync_weights_from_tensor([url], sds[1], "v6", bucket_bytes=40_000, buffers=bufs)
        now = {f for f in _my_shm_files() if f not in before}
        assert now >= set(seen[0]) and len(now) == 4  # the server still maps v5's files
        sync_weights_from_tensor([url], sds[1], "v7", bucket_bytes=40_000, buffers=bufs)
        now = {f for f in _my_shm_files() if f not in before}
        assert not (now & set(seen[0])) and len(now) == 2  # old files unlinked, two new ones
    finally:
        bufs.release()
        proc.kill()
        proc.wait()


def test_tensors_already_in_shared_memory_travel_uncopied(ckpts):
    """A trainer tensor already in shared memory (share_memory_) is sent by its own handle: no bucket
    buffer is needed for it, and the served parameters still equal the trainer's bitwise."""
    sd = {n: t.clone() for n, t in load_safetensors_dir(ckpts[1])}
    names = sorted(sd)
    for n in names[::2]:
        sd[n].share_memory_()
    engine = ReferenceEngine(ckpts[0])
    client = TestClient(create_app(engine))
    try:
        bufs = SharedBucketBuffers()
        url = str(client.base_url)
        sync_weights_from_tensor([url], {n: sd[n] for n in names[::2]}, "z1", http_client=client, transport="shm",
                                 buffers=bufs)
        assert bufs.nbytes == 0  # every tensor went by its own handle
        sync_weights_from_tensor([url], sd, "z2", http_client=client, transport="shm", buffers=bufs)
        private = sum(-(-sd[n].numel() * sd[n].element_size() // 64) * 64 for n in names[1::2])
        assert bufs.nbytes == max(1 << 20, -(-private // (1 << 20)) << 20)  # only the private half was copied
        assert [k for k, t in sd.items() if not torch.equal(engine.mapper.resolve(k, t)[0], t)] == []
    finally:
        engine.close()


def test_buckets_are_pipelined_and_the_version_goes_last(ckpts):
    """The sender keeps up to its buffer depth of buckets in flight (bucket 1 is posted while the
    server still applies bucket 0), sends the weight_version bucket only after every other bucket
    was answered, and the served parameters still equal the trainer's bitwise. Reference: the
    server's own call log (start / end of each update call, wall clock), not the sender's."""
    import threading
    import time

    sd = dict(load_safetensors_dir(ckpts[1]))
    engine = ReferenceEngine(ckpts[0])
    calls, log_lock = [], threading.Lock()
    real = engine.update_weights_from_tensor

    def logged(*args):
        t0 = time.monotonic()
        with log_lock:
            first = not calls
            calls.append(None)
        if first:
            time.sleep(1.0)  # bucket 0 is slow: bucket 1 must arrive while it is being applied
        out = real(*args)
        with log_lock:
            calls[calls.index(None)] = (t0, time.monotonic(), args[3])
        return out

    engine.update_weights_from_tensor = logged
    client = TestClient(create_app(engine))
    try:
        bufs = SharedBucketBuffers(depth=2)
        n = sync_weights_from_tensor([str(client.base_url)], sd, "p1", bucket_bytes=30_000, http_client=client,
                                     transport="shm", buffers=bufs)
        assert n == len(calls) > 3
        versioned = [c for c in calls if c[2] is not None]
        others = [c for c in calls if c[2] is None]
        assert [c[2] for c in versioned] == ["p1"]
        assert versioned[0][0] >= max(c[1] for c in others)  # the version goes after every other bucket
        first = min(calls)
        assert any(c is not first and c[0] < first[1] for c in calls)  # a second bucket in flight meanwhile
        assert [k for k, t in sd.items() if not torch.equal(engine.mapper.resolve(k, t)[0], t)] == []
        assert client.get("/get_model_info").json()["weight_version"] == "p1"
    finally:
        engine.close()


def test_shm_manager_timeout_is_tried_again_and_other_errors_are_not():
    """libshm's 1-second wait for torch_shm_manager's answer (pytorch/pytorch#2482) is tried again up to
    SHM_MANAGER_TRIES calls in all; any other error is raised at the first call."""
    from moerl.rollout import tensor_serde as ts

    timeout = RuntimeError("Shared memory manager connection has timed out\nException raised from recv at socket.h")
    calls = []

    def flaky(fail_times, result, error=timeout):
        def call(*args):
            calls.append(args)
            if len(calls) <= fail_times:
                raise error
            return result
        return call

    assert ts._with_shm_manager(flaky(2, "ok"), 1, 2) == "ok" and calls == [(1, 2)] * 3
    calls.clear()
    with pytest.raises(RuntimeError, match="timed out"):
        ts._with_shm_manager(flaky(ts.SHM_MANAGER_TRIES, "never"))
    assert len(calls) == ts.SHM_MANAGER_TRIES
    calls.clear()
    with pytest.raises(RuntimeError, match="other"):
        ts._with_shm_manager(flaky(1, "never", RuntimeError("other")))
    assert len(calls) == 1
    # the real call: a storage moved to /dev/shm once, its handle a torch shm name
    storage = torch.arange(10, dtype=torch.float32).untyped_storage()
    manager, handle, size = ts.share_filename(storage)
    assert storage.is_shared() and handle.startswith(b"/torch_") and size == 40
    assert ts.share_filename(storage)[1] == handle
