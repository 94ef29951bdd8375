"""``pagedkv inspect ENGINE``: what an engine holds, checked against the engine-I/O contract, with or without a GPU.

    pagedkv inspect model.engine [--json]

Every fact says where it comes from (``source``):

* ``engine record``: what ``pagedkv build`` wrote into the engine's plugin-layer metadata (flavour and version,
  targets, limits, the optimization profile, the network's I/O, each plugin layer's fields), read back from the
  engine bytes (``pagedkv.builder.engine_record``): recorded at build time, but carried by the engine itself;
* ``engine header``: the TensorRT-RTX plan header (version, plan size, compute-capability mask), decoded with the
  layout measured on TensorRT-RTX 1.7.1 (undocumented);
* ``plugin records``: the plugins' own serialized fields in the plan (what ``createPlugin`` gets at run time);
* ``runtime``: TensorRT deserializes the engine (I/O names, dtypes, shapes and the profile straight from
  ``ICudaEngine``), only where a flavour can run it (``pagedkv.runtime.trt.why_no_engine_runtime``); otherwise the
  I/O and profile checked are the engine record's.

The I/O and profile are checked with ``pagedkv.engine_io.check_engine_io``; the header and the plugin records are
held against the record. Exit status 0 when everything agrees, 1 with the problems listed, 2 when the file is not a
pagedkv engine.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field

from pagedkv import engine_io, trt_library
from pagedkv.builder import engine_record
from pagedkv.userio import EXIT_FAILED, UsageError, check_input_file

RECORD, HEADER, PLUGIN_RECORDS, RUNTIME = "engine record", "engine header", "plugin records", "runtime"


@dataclass
class InspectReport:
    engine: str
    bytes: int
    sha256: str
    built_with: dict | None = None  # {"flavour", "title", "version", "source"}
    targets: dict | None = None  # {"compute_capabilities": [...], "source": ...}
    header: dict | None = None  # the decoded TensorRT-RTX header, or {"decoded": False, "reason"}
    limits: dict | None = None
    io: list[dict] = field(default_factory=list)  # [{"name", "mode", "dtype", "shape"}]
    profile: dict = field(default_factory=dict)  # name -> [min, opt, max]
    io_source: str | None = None
    plugins: list[dict] = field(default_factory=list)  # [{"layer", "plugin", "fields", "in_plan"}]
    unrecorded_plugin_records: list[dict] = field(default_factory=list)
    contract: list[str] = field(default_factory=list)  # check_engine_io's problems
    problems: list[str] = field(default_factory=list)  # disagreements between the sources
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.contract and not self.problems


def inspect_engine(path) -> InspectReport:
    src = check_input_file(path, "engine")
    data = src.read_bytes()
    report = InspectReport(str(src), len(data), hashlib.sha256(data).hexdigest())
    found = engine_record.read_record(data)
    header = engine_record.read_rtx_header(data)
    plugin_records = engine_record.read_plugin_fields(data)
    if found.record is None and not found.layers and header is None and not plugin_records:
        raise UsageError(f"engine: {str(src)!r} is not a pagedkv engine (no build record, no TensorRT-RTX header, "
                         "no pagedkv plugin field records)")
    report.problems += found.problems
    record = found.record
    if record is not None:
        report.built_with = {**record["builder"], "source": RECORD}
        report.targets = {"compute_capabilities": record["targets"], "source": RECORD}
        report.limits = record["limits"]
        report.io = [{"name": n, "mode": m, "dtype": d, "shape": s} for n, m, d, s in record["io"]]
        report.profile = record["profile"]
        report.io_source = RECORD
    else:
        report.notes.append("no pagedkv build record in the engine (not built by pagedkv build): flavour, targets, "
                            "limits and I/O come only from what the header or a runtime says")
    _read_header(report, header, data, record)
    _read_runtime(report, data, record)
    _match_plugins(report, found.layers, plugin_records)
    if report.io:
        report.contract = engine_io.check_engine_io(
            [(t["name"], t["mode"] == "input", t["dtype"], t["shape"]) for t in report.io],
            {k: tuple(tuple(s) for s in v) for k, v in report.profile.items()})
    return report


def _read_header(report: InspectReport, header, data: bytes, record) -> None:
    if header is None:
        report.header = {"decoded": False, "reason": "not a TensorRT-RTX plan header (magic 'vtrt'); other plans' "
                                                     "headers are not decoded", "magic": data[:4].hex()}
        return
    report.header = {"decoded": True, "source": f"{HEADER} (TensorRT-RTX 1.7 layout, measured)",
                     "version": header.version, "plan_bytes": header.plan_bytes, "targets": list(header.targets),
                     "unnamed_target_bits": list(header.unnamed_target_bits)}
    if header.plan_bytes != len(data):
        report.problems.append(f"engine header: the plan is {header.plan_bytes} bytes, the file {len(data)}: "
                               "truncated or extended")
    if record is None:
        report.built_with = {"flavour": "tensorrt_rtx", "title": "TensorRT-RTX", "version": header.version,
                             "source": HEADER}
        report.targets = {"compute_capabilities": list(header.targets), "source": HEADER}
        return
    if record["builder"]["flavour"] != "tensorrt_rtx":
        report.problems.append(f"engine header is TensorRT-RTX's, the record says {record['builder']['title']}")
    elif record["builder"]["version"] != header.version:
        report.problems.append(f"engine header: version {header.version}, the record says "
                               f"{record['builder']['version']}")
    if sorted(record["targets"]) != sorted(header.targets):
        report.problems.append(f"engine header: targets {list(header.targets)}, the record says {record['targets']}")
    report.targets["source"] = f"{RECORD}, agreeing with the {HEADER}" if not report.problems else RECORD


def _read_runtime(report: InspectReport, data: bytes, record) -> None:
    """I/O and profile from TensorRT itself, where a flavour can deserialize the engine here."""
    from pagedkv.runtime.trt import why_no_engine_runtime

    name = (record or {}).get("builder", {}).get("flavour") or (report.built_with or {}).get("flavour")
    flavour = trt_library.FLAVOURS.get(name) if name else None
    reason = why_no_engine_runtime(flavour)
    if reason:
        report.notes.append(f"I/O and profile are the {RECORD}'s, not read through a runtime: {reason}")
        return
    trt = trt_library.import_flavour(flavour or trt_library.flavour("auto"))
    trt_library.load_plugin_library(trt)
    engine = trt.Runtime(trt.Logger(trt.Logger.ERROR)).deserialize_cuda_engine(data)
    if engine is None:
        report.problems.append(f"{trt_library.flavour_of(trt).title} could not deserialize the engine"
                               + trt_library.with_plugin_messages())
        return
    tensors, shapes = trt_library.engine_tensors(trt, engine)
    io = [{"name": n, "mode": "input" if is_input else "output", "dtype": d, "shape": s}
          for n, is_input, d, s in tensors]
    profile = {n: [list(s) for s in v] for n, v in shapes.items()}
    if report.io and (io != report.io or profile != report.profile):
        report.problems.append(f"the engine's I/O or profile ({RUNTIME}) differs from the {RECORD}'s")
    report.io, report.profile, report.io_source = io, profile, RUNTIME


def _match_plugins(report: InspectReport, layers: list[dict], plugin_records: list[tuple[str, dict]]) -> None:
    """Each recorded plugin layer against the plugins' own records in the plan."""
    unmatched = list(plugin_records)
    for entry in layers:
        hit = next(((p, f) for p, f in unmatched if p == entry.get("plugin") and f == entry.get("fields")), None)
        if hit is not None:
            unmatched.remove(hit)
        report.plugins.append({**entry, "in_plan": hit is not None})
    if plugin_records:
        missing = [e["layer"] for e in report.plugins if not e["in_plan"]]
        if missing:
            report.problems.append(f"plugin layers {missing}: their recorded fields are in no plugin record of the plan")
    else:
        report.notes.append(f"no {PLUGIN_RECORDS} found in the plan (the layout is TensorRT-RTX's, measured): the "
                            "plugin fields shown are the engine record's")
    if layers:
        report.unrecorded_plugin_records = [{"plugin": p, "fields": f} for p, f in unmatched]
        if unmatched:
            report.problems.append(f"{len(unmatched)} plugin record(s) in the plan match no recorded plugin layer")
    else:  # no record: the plan's own account is all there is
        report.plugins = [{"layer": None, "plugin": p, "fields": f, "in_plan": True} for p, f in plugin_records]


# ---- CLI ----------------------------------------------------------------------------------------------
def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", help="engine file (pagedkv build output)")
    parser.add_argument("--json", action="store_true", help="the report as JSON")


def _print(report: InspectReport) -> None:
    print(f"engine {report.engine}: {report.bytes} bytes, sha256 {report.sha256[:16]}...")
    if report.built_with:
        b = report.built_with
        print(f"built with {b['title']} {b['version']} [{b['source']}]")
    if report.targets:
        print(f"targets: {', '.join(report.targets['compute_capabilities'])} [{report.targets['source']}]")
    h = report.header
    if h and h["decoded"]:
        extra = f" + unnamed bits {h['unnamed_target_bits']}" if h["unnamed_target_bits"] else ""
        print(f"header: TensorRT-RTX {h['version']}, plan {h['plan_bytes']} bytes, targets {', '.join(h['targets'])}"
              f"{extra} [{h['source']}]")
    elif h:
        print(f"header: {h['reason']}")
    if report.limits:
        lim = report.limits
        print(f"limits: max batch {lim['max_batch']}, max tokens {lim['max_tokens']}, max context "
              f"{lim['max_context']} (page size {lim['page_size']}) [{RECORD}]")
    if report.io:
        print(f"I/O [{report.io_source}]:")
        for t in report.io:
            prof = report.profile.get(t["name"])
            extra = f"  profile {prof[0]} / {prof[1]} / {prof[2]}" if prof else ""
            print(f"  {t['mode']:<6} {t['name']:<20} {t['dtype']:<9} {t['shape']}{extra}")
    print(f"plugins ({len(report.plugins)}):")
    for p in report.plugins:
        where = f"{RECORD} + {PLUGIN_RECORDS}" if p["in_plan"] and p["layer"] else PLUGIN_RECORDS if p["in_plan"] \
            else RECORD
        fields = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in p["fields"].items())
        print(f"  {p['layer'] or '(unnamed)'}: {p['plugin']} [{where}]\n    {fields}")
    for note in report.notes:
        print(f"note: {note}")
    print("engine I/O contract: " + ("holds" if not report.contract else f"{len(report.contract)} problem(s)"))
    for line in report.contract + report.problems:
        print(f"  problem: {line}")


def run_inspect(args) -> int:
    from pagedkv.userio import print_json

    report = inspect_engine(args.engine)
    if args.json:
        print_json({**report.__dict__, "ok": report.ok})
    else:
        _print(report)
    return 0 if report.ok else EXIT_FAILED
