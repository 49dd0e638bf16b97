"""The ctypes launcher against a stand-in libcuda (CPU): argument packing, per-thread buffers, and the
wrong-context retry that leaves the caller's current context as it was. Needs a C compiler to build the
stand-in; the real driver path is covered by the GPU tests (non-default stream, two threads)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading

import pytest

from pagedattn.codegen import launch
from pagedattn.ops.params import KvWriteParams

FAKE_DRIVER = r"""
#include <string.h>
static void* current = 0;
static void* stack[16];
static int depth = 0;
static void* const kFuncCtx = (void*)0x1234;
static unsigned long long keys[100000];
static int launches = 0;
static unsigned char last[512];
static unsigned last_grid = 0;
static unsigned long long last_stream = 0;
static unsigned last_dims[7];

typedef struct {  /* CUlaunchConfig */
  unsigned grid[3], block[3], smem;
  void* stream;
  void* attrs;
  unsigned num_attrs;
} Config;

void fake_set_current(void* c) { current = c; }
void* fake_current(void) { return current; }
int fake_launches(void) { return launches; }
unsigned long long fake_key(int i) { return keys[i]; }
void fake_last(unsigned char* out, int n) { memcpy(out, last, n); }
unsigned fake_last_grid(void) { return last_grid; }
unsigned long long fake_last_stream(void) { return last_stream; }
unsigned fake_last_dim(int i) { return last_dims[i]; }

int cuLaunchKernelEx(const Config* c, void* f, void** params, void** extra) {
  if (current != kFuncCtx) return 201;  /* CUDA_ERROR_INVALID_CONTEXT */
  if (f != (void*)0xF00D || c->attrs || c->num_attrs || extra) return 1;  /* CUDA_ERROR_INVALID_VALUE */
  memcpy(last, params[0], sizeof(last) < 256 ? sizeof(last) : 256);
  memcpy(&keys[launches % 100000], params[0], 8);
  last_grid = c->grid[0];
  last_stream = (unsigned long long)c->stream;
  memcpy(last_dims, c, sizeof(last_dims));
  __atomic_fetch_add(&launches, 1, __ATOMIC_SEQ_CST);
  return 0;
}
int cuCtxPushCurrent_v2(void* c) { stack[depth++] = current; current = c; return 0; }
int cuCtxPopCurrent_v2(void** c) { if (c) *c = current; current = stack[--depth]; return 0; }
"""


@pytest.fixture
def fake_driver(tmp_path, monkeypatch):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in driver")
    src, lib = tmp_path / "fake_cuda.c", tmp_path / "libfake_cuda.so"
    src.write_text(FAKE_DRIVER)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    real = ctypes.PyDLL
    monkeypatch.setattr(launch.ctypes, "PyDLL", lambda name, *a, **k: real(str(lib)))
    monkeypatch.setattr(launch, "_driver", None)
    monkeypatch.setattr(launch, "primary_context", lambda device: 0x1234)
    fake = ctypes.CDLL(str(lib))
    fake.fake_current.restype = ctypes.c_void_p
    fake.fake_key.restype = ctypes.c_ulonglong
    fake.fake_last_grid.restype = ctypes.c_uint
    fake.fake_last_stream.restype = ctypes.c_ulonglong
    fake.fake_last_dim.restype = ctypes.c_uint
    import torch

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: STREAM, raising=False)
    yield fake
    monkeypatch.setattr(launch, "_driver", None)


STREAM = 0x7F00_0000_1000  # torch's current raw stream in these tests: a 64-bit handle


def _dims(fake) -> tuple:
    """(grid, block, shared memory) of the last launch's CUlaunchConfig."""
    d = [fake.fake_last_dim(i) for i in range(7)]
    return tuple(d[:3]), tuple(d[3:6]), d[6]


def _values(key_ptr: int) -> tuple:
    # KvWriteParams flattened: 10 pointers, 2 strides, CacheGeometry (4 i64 + 4 i32), 7 i32
    return (key_ptr, 2, 3, 4, 5, 0, 0, 0, 0, 0, 1024, 1024, 16384, 1024, 128, 4096, 256, 16, 8, 128, 0, 1, 7,
            0, 0, 0, 0)


def test_launch_packs_params_like_the_compiler(fake_driver):
    fake_driver.fake_set_current(ctypes.c_void_p(0x1234))
    launcher = launch.Launcher(0xF00D, KvWriteParams, 0)
    launcher((7, 2, 3), (256, 1, 1), _values(0xABCDEF))
    assert fake_driver.fake_launches() == 1 and fake_driver.fake_last_grid() == 7
    assert _dims(fake_driver) == ((7, 2, 3), (256, 1, 1), 0) and fake_driver.fake_last_stream() == STREAM
    raw = (ctypes.c_ubyte * ctypes.sizeof(KvWriteParams))()
    fake_driver.fake_last(raw, ctypes.sizeof(KvWriteParams))
    got = KvWriteParams.from_buffer_copy(bytes(raw))
    assert got.key == 0xABCDEF and got.value == 2 and got.key_stride == 1024
    assert (got.cache.num_blocks, got.cache.block_size, got.cache.num_heads, got.cache.head_size) == (256, 16, 8, 128)
    assert got.slot_is_int64 == 1 and got.num_tokens == 7


def test_an_explicit_stream_and_shared_memory_reach_the_config(fake_driver):
    fake_driver.fake_set_current(ctypes.c_void_p(0x1234))
    launcher = launch.Launcher(0xF00D, KvWriteParams, 0, dynamic_smem=99 * 1024)
    launcher((5, 1, 1), (128, 1, 1), _values(0x10), stream=0xFFFF_FFFF_FFFF_FFF0)
    assert _dims(fake_driver) == ((5, 1, 1), (128, 1, 1), 99 * 1024)
    assert fake_driver.fake_last_stream() == 0xFFFF_FFFF_FFFF_FFF0
    launcher.prepare((5, 1, 1), (128, 1, 1), 7, _values(0x10)[7:])(*_values(0x10)[:7])
    assert _dims(fake_driver) == ((5, 1, 1), (128, 1, 1), 99 * 1024) and fake_driver.fake_last_stream() == STREAM


def test_the_launch_config_mirrors_cuda_h():
    """CUlaunchConfig on x86-64 / aarch64: seven uint32, the stream at 32, attrs at 40, numAttrs at 48."""
    assert (launch.CONFIG_BYTES, launch.STREAM_OFFSET) == (56, 32)
    assert (launch.LaunchConfig.attrs.offset, launch.LaunchConfig.numAttrs.offset) == (40, 48)


def test_wrong_context_is_pushed_for_one_launch_and_restored(fake_driver):
    launcher = launch.Launcher(0xF00D, KvWriteParams, 0)
    for other in (0x0, 0x9999):  # no context yet, another device's context
        fake_driver.fake_set_current(ctypes.c_void_p(other))
        before = fake_driver.fake_launches()
        launcher((1, 1, 1), (32, 1, 1), _values(0x1))
        assert fake_driver.fake_launches() == before + 1
        assert (fake_driver.fake_current() or 0) == other  # the caller's context is left as it was


def test_threads_never_mix_their_params(fake_driver):
    fake_driver.fake_set_current(ctypes.c_void_p(0x1234))
    launcher = launch.Launcher(0xF00D, KvWriteParams, 0)
    # the stand-in's "current context" is process-wide, so every thread sees the right one
    _launch_from_threads(fake_driver, lambda key: launcher((1, 1, 1), (32, 1, 1), _values(key)))


def _launch_from_threads(fake_driver, launch_one, per_thread=2000, threads=4):
    """launch_one(key) from `threads` threads, `per_thread` keys each: every key reaches the driver once."""
    def work(t):
        for i in range(per_thread):
            launch_one((t << 32) | i)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    n = fake_driver.fake_launches()
    assert n == per_thread * threads
    assert {fake_driver.fake_key(i) for i in range(n)} == {(t << 32) | i for t in range(threads) for i in range(per_thread)}


def test_threads_never_mix_their_prepared_params(fake_driver):
    """A Prepared launch's buffer is per thread too: every thread's addresses reach the driver intact."""
    fake_driver.fake_set_current(ctypes.c_void_p(0x1234))
    launcher = launch.Launcher(0xF00D, KvWriteParams, 0)
    prepared = launcher.prepare((1, 1, 1), (32, 1, 1), 10, _values(0)[10:])
    _launch_from_threads(fake_driver, lambda key: prepared.launch(key, 2, 3, 4, 5, 0, 0, 0, 0, 0))


def test_a_prepared_launch_packs_what_a_full_one_does(fake_driver):
    """Launcher.prepare: the fields after the first n packed once; calls fill in the first n."""
    fake_driver.fake_set_current(ctypes.c_void_p(0x1234))
    launcher = launch.Launcher(0xF00D, KvWriteParams, 0)
    size = ctypes.sizeof(KvWriteParams)

    def last():
        raw = (ctypes.c_ubyte * size)()
        fake_driver.fake_last(raw, size)
        return bytes(raw)

    for n_head in (10, 12, 0, len(_values(0))):
        launcher((3, 2, 1), (64, 1, 1), _values(0xABC))
        want = last(), _dims(fake_driver)
        prepared = launcher.prepare((3, 2, 1), (64, 1, 1), n_head, _values(0xABC)[n_head:])
        for _ in range(2):
            prepared(*_values(0xABC)[:n_head])
            assert (last(), _dims(fake_driver)) == want and fake_driver.fake_last_stream() == STREAM
    fake_driver.fake_set_current(ctypes.c_void_p(0x9999))  # the wrong-context retry applies too
    before = fake_driver.fake_launches()
    prepared(*_values(0xABC)[:len(_values(0))])
    assert fake_driver.fake_launches() == before + 1 and (fake_driver.fake_current() or 0) == 0x9999


def test_max_active_clusters_asks_the_driver_and_falls_back(monkeypatch, capfd):
    """Launcher.max_active_clusters (prefill_ws's kWsPair sizes its persistent grid with it): the
    driver's count for the kernel's cluster shape, block and dynamic shared memory; None for a stand-in
    launcher, and None with a warning where the driver cannot say (the caller then assumes SMs / 2)."""
    import contextlib

    from cuda.bindings import driver

    from pagedattn.codegen import load

    lau = launch.Launcher.stand_in(lambda *a: 0, KvWriteParams)
    assert lau.max_active_clusters(384, 2) is None
    lau._driver, lau._smem = object(), 232448  # as if bound to a real kernel
    monkeypatch.setattr(load, "in_context", lambda device: contextlib.nullcontext())
    seen = []

    def occupancy(func, config):
        seen.append((config.gridDimX, config.blockDimX, config.sharedMemBytes))
        return driver.CUresult.CUDA_SUCCESS, 66

    monkeypatch.setattr(driver, "cuOccupancyMaxActiveClusters", occupancy)
    assert lau.max_active_clusters(384, 2) == 66 and seen == [(2, 384, 232448)]
    monkeypatch.setattr(driver, "cuOccupancyMaxActiveClusters",
                        lambda func, config: (driver.CUresult.CUDA_ERROR_NOT_SUPPORTED, 0))
    assert lau.max_active_clusters(384, 2) is None
    assert "cuOccupancyMaxActiveClusters failed" in capfd.readouterr().err  # the "pagedattn" logger's warning
