"""Shared version buffers (`weights.shared_buffer`): another process maps them read-only, a
released buffer can no longer be opened (even when the kernel reuses its fd number), and
mappings made before stay valid."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from laminar_jax.weights import shared_buffer as sb

pytestmark = pytest.mark.skipif(not sb.available(), reason="needs memfd_create and /proc")

READER = """
import json, sys
import numpy as np
from laminar_jax.weights import shared_buffer as sb
handle = sb.BufferHandle.from_json(json.loads(sys.argv[1]))
try:
    view = sb.open_handle(handle)
except sb.BufferGone as e:
    print(json.dumps({"gone": str(e)}))
    sys.exit(0)
try:
    view[0] = 1
    wrote = True
except ValueError:
    wrote = False
print(json.dumps({"sum": int(view.astype(np.int64).sum()), "writeable": bool(view.flags.writeable),
                  "wrote": wrote}))
"""


def _read_in_another_process(handle):
    out = subprocess.run([sys.executable, "-c", READER, json.dumps(handle.to_json())],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_another_process_maps_the_bytes_read_only():
    buf = sb.SharedBuffer(3 * 2**20 + 5)
    data = np.random.default_rng(0).integers(0, 256, buf.nbytes, dtype=np.uint8)
    buf.array[:] = data
    got = _read_in_another_process(buf.handle)
    assert got == {"sum": int(data.astype(np.int64).sum()), "writeable": False, "wrote": False}
    assert np.array_equal(buf.array, data)   # the reader changed nothing


def test_a_released_buffer_is_gone_even_when_its_fd_number_is_reused():
    old = sb.SharedBuffer(2**16)
    old.array[:] = 7
    handle = old.handle
    old.release()
    assert "gone" in _read_in_another_process(handle)
    new = sb.SharedBuffer(2**16)            # the lowest free fd: usually the one just closed
    new.array[:] = 9
    assert "gone" in _read_in_another_process(dataclasses.replace(handle, fd=new.handle.fd))
    # the owner's own mapping of the released buffer still holds its bytes
    assert int(old.array.sum()) == 7 * 2**16


def test_mapping_survives_the_release_of_the_buffer():
    buf = sb.SharedBuffer(4096)
    buf.array[:] = np.arange(4096) % 251
    view = sb.open_handle(buf.handle)
    buf.release()
    del buf
    assert np.array_equal(view, np.arange(4096) % 251)
    with pytest.raises(ValueError):
        view[0] = 0


def test_a_handle_from_another_host_is_not_local():
    buf = sb.SharedBuffer(4096)
    with pytest.raises(sb.NotLocal, match="on host"):
        sb.open_handle(dataclasses.replace(buf.handle, host="another-boot:1"))


def test_pool_hands_out_the_prepared_buffer_and_allocates_other_sizes():
    pool = sb.BufferPool()
    pool.prepare(8192)
    first = pool.take(8192)
    assert first.nbytes == 8192 and first.array.flags.writeable
    pool.prepare(8192)
    other = pool.take(4096)            # the prepared one does not fit: a new one
    assert other.nbytes == 4096 and other.handle.inode != first.handle.inode
    again = pool.take(8192)
    assert again.handle.inode not in (first.handle.inode, other.handle.inode)
    with pytest.raises(ValueError, match="nbytes"):
        sb.SharedBuffer(0)
