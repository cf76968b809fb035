"""Zip archives built to fool or exhaust the readers (capture/pt2/zipcheck.py, archive.py): each test crafts
the file itself and checks the answer (exit 2, one line naming the fault) and that nothing ran or was
inflated.

A zip whose two readers (Python's zipfile, torch's) see different members; data before the first member and
members that overlap; a member name that is not UTF-8; a zip bomb, and a member whose header lies about its
size; a nested zip bomb in a .pt2's sample inputs and in an --inputs file; a file too large for memory, and a
sparse one read in full before any check.
"""

from __future__ import annotations

import io
import resource
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from ckpt_planner.capture.pt2 import archive
from ckpt_planner.cli.loading import load_model
from ckpt_planner.errors import InputError

from ..cli.cli_checks import one_line, run
from ..cli.test_security import FACTORY
from .pt2_checks import members, with_size_expression, write

# -- zips written byte by byte, so that offsets can say what the attacker wants -----------------


def local(name: str, data: bytes) -> bytes:
    """A stored member's local header, name and data."""
    raw = name.encode()
    return struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                       len(raw), 0) + raw + data


def central(name: str, data: bytes, offset: int, *, flags: int = 0, raw: bytes | None = None) -> bytes:
    """A stored member's central directory entry, its local header at `offset`."""
    raw = name.encode() if raw is None else raw
    return struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, flags, 0, 0, 0, zlib.crc32(data), len(data),
                       len(data), len(raw), 0, 0, 0, 0, 0, offset) + raw


def end_record(entries: int, cd_size: int, cd_offset: int) -> bytes:
    return struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, entries, entries, cd_size, cd_offset, 0)


def directory(data: bytes) -> tuple[bytes, bytes, int]:
    """(the members' bytes, the central directory, its entries) of a zip written by zipfile."""
    at = data.rindex(b"PK\x05\x06")
    entries, size, offset = struct.unpack("<H2I", data[at + 10:at + 20])
    return data[:offset], data[offset:offset + size], entries


def shift_entries(cd: bytes, delta: int) -> bytes:
    """The central directory with every local header offset moved by `delta`."""
    out, pos = bytearray(cd), 0
    while pos < len(out):
        name_len, extra_len, comment_len = struct.unpack("<3H", out[pos + 28:pos + 34])
        (offset,) = struct.unpack("<I", out[pos + 42:pos + 46])
        out[pos + 42:pos + 46] = struct.pack("<I", offset + delta)
        pos += 46 + name_len + extra_len + comment_len
    return bytes(out)


def zip_of(root: str, files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            z.writestr(f"{root}/{name}", data)
    return buf.getvalue()


def two_faced(shown: bytes, hidden: bytes) -> bytes:
    """One file that Python's zipfile reads as `shown` and torch's reader as `hidden` (same member names).

    Layout: hidden's members, shown's members, hidden's directory, shown's directory, one end record that
    states hidden's directory. zipfile takes the directory just before the end record (shown's) and shifts
    its offsets by the difference, so shown's entries are written that much short."""
    hidden_members, hidden_cd, entries = directory(hidden)
    shown_members, shown_cd, shown_entries = directory(shown)
    assert entries == shown_entries and len(hidden_cd) == len(shown_cd)
    shown_cd = shift_entries(shown_cd, len(hidden_members) - len(shown_cd))
    stated = len(hidden_members) + len(shown_members)
    return hidden_members + shown_members + hidden_cd + shown_cd + end_record(entries, len(hidden_cd), stated)


# -- two readers, one archive, and members that are not where they say --------------------------


def test_zip_whose_two_readers_disagree_runs_no_code(clean_pt2, tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = with_size_expression(clean_pt2, tmp_path / "evil.pt2", f"__import__('pathlib').Path({str(marker)!r}).touch() "
                                "or {hint}")
    root, files = members(clean_pt2)
    _, evil_files = members(evil)
    path = tmp_path / "diff.pt2"
    path.write_bytes(two_faced(zip_of(root, files), zip_of(root, evil_files)))
    # The file really is two-faced: the allowlist's reader sees the clean graph, torch's the payload.
    with zipfile.ZipFile(path) as z:
        assert b"__import__" not in z.read(f"{root}/models/model.json")
    assert b"__import__" in bytes(torch._C.PyTorchFileReader(str(path)).get_record("models/model.json"))

    code, err = run(["profile", path], capsys)
    line = one_line(err)
    assert not marker.exists(), "the payload ran"
    assert code == 2 and "central directory" in line and "export and save the model again" in line, line
    with pytest.raises(InputError, match="central directory"):
        load_model(str(path), trust_pickle=True)  # the layout holds whatever the user trusts
    assert not marker.exists(), "the payload ran"


def test_data_before_the_first_member_and_overlapping_members_are_refused(clean_pt2, tmp_path, capsys):
    data = clean_pt2.read_bytes()
    body, cd, entries = directory(data)
    junk = b"#!/bin/sh\n" + b"\0" * 990  # offsets all moved to match: both readers would read it alike
    prepended = tmp_path / "prepended.pt2"
    prepended.write_bytes(junk + body + shift_entries(cd, len(junk)) + end_record(entries, len(cd), len(junk) + len(body)))
    with zipfile.ZipFile(prepended) as z:
        assert z.testzip() is None
    code, err = run(["profile", prepended], capsys)
    line = one_line(err)
    assert code == 2 and "1000 bytes of other data come before its first member" in line, line

    # extra/outer.txt's data is the whole of extra/inner.txt, header included; both are listed
    root, files = members(clean_pt2)
    body, cd, entries = directory(zip_of(root, files))
    inner_name, outer_name = f"{root}/extra/inner.txt", f"{root}/extra/outer.txt"
    inner = local(inner_name, b"inner")
    at = len(body)
    body += local(outer_name, inner)
    cd += central(outer_name, inner, at) + central(inner_name, b"inner", at + 30 + len(outer_name.encode()))
    overlapping = tmp_path / "overlap.pt2"
    overlapping.write_bytes(body + cd + end_record(entries + 2, len(cd), len(body)))
    with zipfile.ZipFile(overlapping) as z:
        assert z.read(inner_name) == b"inner" and z.read(outer_name) == inner
    with pytest.raises(InputError, match="overlap"):
        load_model(str(overlapping), trust_pickle=True)
    code, err = run(["profile", overlapping], capsys)
    assert code == 2 and "overlap" in one_line(err)


def test_member_name_that_is_not_utf8_is_one_line(clean_pt2, tmp_path, capsys):
    root, files = members(clean_pt2)
    body, cd, entries = directory(zip_of(root, files))
    raw = f"{root}/extra/".encode() + b"\xff\xfe.txt"  # read as cp437 by zipfile, as UTF-8 by torch
    head = struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(b"x"), 1, 1, len(raw), 0) + raw + b"x"
    at = len(body)
    body += head
    cd += central("", b"x", at, raw=raw)
    path = tmp_path / "name.pt2"
    path.write_bytes(body + cd + end_record(entries + 1, len(cd), len(body)))
    code, err = run(["profile", path], capsys)
    line = one_line(err)
    assert code == 2 and "not UTF-8" in line and "name.pt2" in line, line


# -- zip bombs ------------------------------------------------------------------------------------


def bomb(clean: Path, dst: Path, size: int) -> Path:
    """weight_0, a name the allowlist accepts, deflated from `size` zero bytes."""
    root, files = members(clean)
    files.pop("data/weights/weight_0")
    write(dst, root, files)
    with zipfile.ZipFile(dst, "a", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open(f"{root}/data/weights/weight_0", "w", force_zip64=True) as f:
            zeros = bytes(1 << 20)
            for _ in range(size >> 20):
                f.write(zeros)
    return dst


def test_zip_bomb_is_refused_from_its_headers(clean_pt2, tmp_path, capsys):
    evil = bomb(clean_pt2, tmp_path / "bomb.pt2", 300 << 20)  # 300 MiB of zeros in about 1.4 MB
    assert evil.stat().st_size < 4 << 20
    code, err = run(["plan", evil, "--curve-points", "0"], capsys)
    line = one_line(err)
    assert code == 2 and "weight_0" in line and "limit" in line, line
    with pytest.raises(InputError, match="limit"):
        load_model(str(evil), trust_pickle=True)  # a size limit holds even for a trusted file


def test_member_whose_header_lies_about_its_size_is_stopped_while_reading(clean_pt2, tmp_path, capsys):
    """The graph JSON's headers claim 100 bytes; inflating stops there and the file is refused."""
    root, files = members(clean_pt2)
    files["models/model.json"] = files["models/model.json"] + b" " * (8 << 20)
    path = write(tmp_path / "liar.pt2", root, files, deflated=("models/model.json",))
    data = bytearray(path.read_bytes())
    name = f"{root}/models/model.json".encode()
    for sig, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        pos = 0
        while (pos := data.find(sig, pos)) >= 0:
            start = pos + (30 if sig == b"PK\x03\x04" else 46)
            if data[start:start + len(name)] == name:
                data[pos + size_at:pos + size_at + 4] = struct.pack("<I", 100)
            pos += 4
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as z:
        assert z.getinfo(f"{root}/models/model.json").file_size == 100
    code, err = run(["plan", path, "--curve-points", "0"], capsys)
    line = one_line(err)
    assert code == 2 and "models/model.json" in line, line


BOMB_BYTES = 300 << 20  # past the 256 MiB all levels of one archive may inflate together


def torch_save_bomb(size: int = BOMB_BYTES, *, declared: int | None = None) -> bytes:
    """A torch.save zip of `(tensor,)` whose storage member is `size` zero bytes, deflated (about 1000:1);
    `declared` makes the headers claim another inflated size."""
    buf = io.BytesIO()
    torch.save((torch.zeros(4),), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        parts = {i.filename: z.read(i) for i in z.infolist()}
    storage = next(n for n in parts if n.endswith("/data/0"))
    # the storage member, deflated, is appended by hand so that its headers can state any size
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, data in parts.items():
            if name != storage:
                z.writestr(name, data)
    body, cd, entries = directory(out.getvalue())
    deflate = zlib.compressobj(1, zlib.DEFLATED, -15)
    chunk, crc, stream = bytes(1 << 20), 0, []
    for _ in range(size >> 20):
        stream.append(deflate.compress(chunk))
        crc = zlib.crc32(chunk, crc)
    stream.append(deflate.flush())
    packed = b"".join(stream)
    stated = size if declared is None else declared
    raw = storage.encode()
    at = len(body)
    body += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(packed), stated, len(raw), 0) + raw + packed
    cd += struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(packed), stated, len(raw),
                      0, 0, 0, 0, 0, at) + raw
    return body + cd + end_record(entries + 1, len(cd), len(body))


@pytest.fixture(scope="module")
def bomb_bytes() -> bytes:
    return torch_save_bomb()


@pytest.fixture
def torch_loads(monkeypatch) -> list:
    """Every torch.load call, recorded (and still made)."""
    calls: list = []
    real = torch.load

    def recorded(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recorded)
    return calls


def test_nested_zip_bomb_in_sample_inputs_is_refused_before_torch_load(clean_pt2, tmp_path, capsys, bomb_bytes,
                                                                        torch_loads):
    root, files = members(clean_pt2)
    files["data/sample_inputs/model.pt"] = bomb_bytes
    path = write(tmp_path / "nested.pt2", root, files)
    assert path.stat().st_size < 2 << 20
    code, err = run(["profile", path], capsys)
    line = one_line(err)
    assert code == 2 and "data/sample_inputs/model.pt" in line and "inflate" in line and "limit" in line, line
    assert torch_loads == [], "torch.load inflated the nested archive"
    with pytest.raises(InputError, match="inflate"):
        load_model(str(path), trust_pickle=True)  # the caps hold for a trusted file too
    assert torch_loads == []


def test_nested_member_whose_header_lies_is_stopped_while_inflating(clean_pt2, tmp_path):
    root, files = members(clean_pt2)
    files["data/sample_inputs/model.pt"] = torch_save_bomb(8 << 20, declared=16)  # claims the 16 bytes of zeros(4)
    data = write(tmp_path / "liar.pt2", root, files).read_bytes()
    # zipfile stops at the stated size and the check sum then fails: inflating ends at 16 bytes, not 8 MiB
    with pytest.raises(InputError, match=r"model\.pt' \(a torch\.save archive\): member 'data/0' cannot be read"):
        archive.unsafe_members(data)


def test_nested_zip_bomb_as_inputs_file_is_refused_before_torch_load(tmp_path, capsys, bomb_bytes, torch_loads):
    (tmp_path / "factory.py").write_text(FACTORY)
    inputs = tmp_path / "inputs.pt"
    inputs.write_bytes(bomb_bytes)
    code, err = run(["profile", f"{tmp_path / 'factory.py'}:make", "--inputs", inputs], capsys)
    line = one_line(err)
    assert code == 2 and "inputs file" in line and "inflate" in line and "torch.save" in line, line
    assert torch_loads == [], "torch.load inflated the inputs file"


# -- files larger than memory ----------------------------------------------------------------------


def test_sparse_10_gib_file_is_refused_without_reading_it(tmp_path):
    """Under an 8 GiB address-space limit, reading the file whole fails; checking it first does not."""
    big = tmp_path / "sparse.pt2"
    with big.open("wb") as f:
        f.truncate(10 << 30)  # a hole: no disk used, nothing written
    (tmp_path / "factory.py").write_text(FACTORY)
    sparse_inputs = tmp_path / "sparse_inputs.pt"
    with sparse_inputs.open("wb") as f:
        f.write(b"PK\x03\x04")  # read as a zip by torch.load
        f.truncate(10 << 30)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    for argv in (["profile", str(big)], ["profile", f"{tmp_path / 'factory.py'}:make", "--inputs", str(sparse_inputs)]):
        proc = subprocess.run([sys.executable, "-m", "ckpt_planner.cli.commands", *argv], capture_output=True,
                              text=True, timeout=300, preexec_fn=limited, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = one_line(proc.stderr)
        assert any(why in line for why in ("not a zip file", "not a torch.save file", "memory")), line


def test_archive_larger_than_memory_allows_is_refused_before_reading(clean_pt2, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(archive, "memory_bytes", lambda: 64 << 10)
    code, err = run(["profile", clean_pt2], capsys)
    line = one_line(err)
    assert code == 2 and "twice that in memory" in line, line
