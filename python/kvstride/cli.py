"""The ``kvstride`` command: ``explain`` a group mix, ``simulate`` a chat workload through the
offload engine, ``bench`` the core and data plane, ``store serve`` a Mooncake store that
outlives the engines.

One file for every subcommand's options, checks and messages: each command is a short
``_cmd_*`` function over modules that do the work (``simulate``, ``trace``, ``explain`` in
``kvstride._core``, ``stores.mooncake_master``), and most of its length is argparse's option
tables and their one-line errors, which read best next to each other."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from kvstride import _core
from kvstride.capacity import PrefixOrder
from kvstride.mixes import PRESETS, Mix, format_groups, model_mix, resolve_mix
from kvstride.mooncake_config import MOONCAKE_PIP


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr naming the option and a valid form, exit 2, before any
    work starts (no usage dump to read it out of)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: give a whole number >= {minimum}")
        return value

    return parse


_POSITIVE = _int_at_least(1)
_NON_NEGATIVE = _int_at_least(0)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text}: give a finite number >= 0")
    return value


def _store_url(text: str) -> str:
    """``embedded``, ``mooncake`` or ``mooncake://HOST:PORT``."""
    if text in ("embedded", "mooncake"):
        return text
    host, sep, port = text[len("mooncake://"):].rpartition(":") if text.startswith("mooncake://") else ("", "", "")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"{text!r}: use embedded, mooncake or mooncake://HOST:PORT")
    return text


def _writable_path(suffix: Optional[str] = None):
    """A file path whose folder exists and is writable (checked now, not after a long run)."""
    def parse(text: str) -> str:
        import os

        if suffix and not text.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(f"{text!r}: give a {suffix} file name")
        folder = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder} is not writable")
        return text

    return parse


def _size(text: str, example: str = "1G or 512MiB", positive: bool = False) -> int:
    """A size such as 256G or 4TiB (binary units), >= 0 (``positive``: > 0); ``--store-bytes``."""
    from kvstride.sizes import parse_size

    try:
        size = parse_size(text)
    except (ValueError, OverflowError):  # not a size; inf
        size = None
    if size is None or (positive and size <= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a size{' > 0' if positive else ''} such as {example}")
    return size


def _capacities(text: str) -> List[int]:
    """``--capacity``: sizes such as 256G or 1T (binary units), comma-separated, each > 0."""
    out = [_size(item, "256G or 1T", positive=True) for item in (t.strip() for t in text.split(",") if t.strip())]
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes such as 256G,1T")
    return out


def _disk_size(text: str) -> int:
    """``--disk-bytes``: one size > 0."""
    return _size(text, "4T or 512G", positive=True)


def _disk_folder(text: str) -> str:
    """``--disk-path``: an existing folder this process may write."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder: create it (mkdir -p {text}) or give another")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable by this process")
    return text


def _checkpoints(text: str) -> str:
    """``--checkpoints``: connector, or a comma list of end, hedge, junction, every:T."""
    items = [t.strip() for t in text.split(",")]
    for item in items:
        every = item.startswith("every:") and item[6:].isdigit() and int(item[6:]) > 0
        if not (every or item in ("end", "hedge", "junction") or (item == "connector" and len(items) == 1)):
            raise argparse.ArgumentTypeError(
                f"{item!r}: use connector, or a comma list of end, hedge, junction and every:T (T tokens > 0)"
            )
    return text


def _mix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named group mix (default: llama)",
    )
    parser.add_argument(
        "--groups",
        help='group mix as text, e.g. "full_attention:16,mamba:64,circular_buffer:4" '
        "(settings per group: :window=N :mode=align|all|none :cacheable=true|false :heads=N)",
    )
    parser.add_argument("--prefix-match-unit", type=_POSITIVE, default=None, help="hash block size H override")
    parser.add_argument("--dcp", type=_POSITIVE, default=1, help="decode context parallel size")
    parser.add_argument("--algo", default="sha256_cbor", choices=list(_core.HASH_ALGOS),
                        help="block-hash algorithm (vLLM's --prefix-caching-hash-algo)")
    parser.add_argument("--seed", default="0", help="hash seed (vLLM: PYTHONHASHSEED)")
    parser.add_argument(
        "--model",
        help="a model's geometry instead of --preset / --groups: its checkpoint folder, its config.json or a "
        "Hugging Face id in the local cache (attention models), a name shipped in python/kvstride/models "
        "(qwen3-next-80b, gemma-3-27b, gpt-oss-120b, nemotron-h) or a JSON file of that form",
    )
    parser.add_argument("--namespace", default="demo-model", help="the model name in the key namespace")


# ---- explain -------------------------------------------------------------------------------


def _try_resolve(groups, unit, dcp):
    try:
        return _core.resolve_block_sizes(list(groups), prefix_match_unit=unit, dcp=dcp), None
    except ValueError as err:
        return None, str(err)


def _with(group, **changes):
    fields = dict(
        window=group.window,
        mamba_mode=group.mamba_mode,
        prefix_cacheable=group.prefix_cacheable,
        num_kv_heads=group.num_kv_heads,
    )
    fields.update(changes)
    kind = changes.pop("kind", group.kind)
    block_size = fields.pop("block_size", group.block_size)
    return _core.GroupSpec(kind, block_size, **fields)


def nearest_working_mixes(groups, unit, dcp, limit: int = 5) -> List[tuple]:
    """Small edits of a mix that cannot be keyed, each checked with the core:
    ``(description, groups, prefix_match_unit, (S, H))``."""
    candidates = []
    non_align = [i for i, g in enumerate(groups) if g.kind == "mamba" and g.mamba_mode != "align"]
    if non_align:
        edited = [_with(g, mamba_mode="align") if i in non_align else g for i, g in enumerate(groups)]
        names = ", ".join(f"group {i}" for i in non_align)
        candidates.append((f"set mamba mode align on {names}", edited, unit))
    for i, g in enumerate(groups):
        if g.prefix_cacheable and sum(x.prefix_cacheable for x in groups) > 1:
            edited = [_with(x, prefix_cacheable=False) if j == i else x for j, x in enumerate(groups)]
            candidates.append((f"mark group {i} ({g.kind}) prefix_cacheable=False", edited, unit))
    if unit is not None:
        candidates.append(("drop --prefix-match-unit (H = gcd of the block sizes)", list(groups), None))
    # Resize one group to the nearest block size that shares a unit with the others.
    for i, g in enumerate(groups):
        others = [x for j, x in enumerate(groups) if j != i and x.prefix_cacheable]
        if not others:
            continue
        per_token = 1 if g.kind == "mamba" else dcp
        step = 0
        for x in others:
            step = math.gcd(step, x.block_size if x.kind == "mamba" else x.block_size * dcp)
        if unit:
            step = math.lcm(step, unit) if step % unit else step
        for size in sorted({max(step, g.block_size * per_token // step * step), -(-g.block_size * per_token // step) * step}):
            if size % per_token or size // per_token == g.block_size:
                continue
            edited = [_with(x, block_size=size // per_token) if j == i else x for j, x in enumerate(groups)]
            candidates.append((f"resize group {i} ({g.kind}) to {size // per_token} tokens", edited, unit))
    working = []
    for description, edited, edited_unit in candidates:
        sizes, _ = _try_resolve(edited, edited_unit, dcp)
        if sizes is not None:
            working.append((description, edited, edited_unit, sizes))
    return working[:limit]


def _participation_reason(group, takes_part: bool, any_cacheable: bool) -> str:
    if takes_part:
        return "prefix-cacheable" if group.prefix_cacheable else "no group is prefix-cacheable: all take part"
    if group.kind == "circular_buffer":
        return "per-request scratch ring: never prefix-cacheable, skipped everywhere"
    return "prefix_cacheable=False: skipped everywhere"


def explain(mix: Mix, args, out=None) -> int:
    out = out if out is not None else sys.stdout  # looked up per call: stdout may be redirected
    groups, unit, dcp = list(mix.groups), mix.prefix_match_unit, args.dcp
    print(f"mix: {mix.name}  --groups \"{format_groups(groups)}\"", file=out)
    if mix.note:
        print(f"     {mix.note}", file=out)
    if unit:
        print(f"     prefix_match_unit={unit}", file=out)
    sizes, error = _try_resolve(groups, unit, dcp)
    if sizes is None:
        print("\nthis mix cannot be keyed:\n  " + error, file=out)
        working = nearest_working_mixes(groups, unit, dcp)
        if working:
            print("\nnearest mixes that work:", file=out)
            for description, edited, edited_unit, (s, h) in working:
                flag = f" --prefix-match-unit {edited_unit}" if edited_unit else ""
                print(f"  - {description}: S={s} H={h}", file=out)
                print(f"      kvstride explain --groups \"{format_groups(edited)}\"{flag}", file=out)
        return 2
    s, h = sizes
    per_block = _core.hashes_per_block(groups, h, dcp=dcp)
    planner = _core.KeyPlanner(
        groups,
        hash_block_size=h,
        scheduler_block_size=s,
        namespace=_core.Namespace(
            args.namespace,
            fingerprint=_core.layout_fingerprint(
                {"groups": format_groups(groups), "S": s, "H": h, "algo": args.algo, "seed": args.seed, "dcp": dcp}
            ),
        ),
        dcp=dcp,
    )
    any_cacheable = any(g.prefix_cacheable for g in groups)
    print(f"\nS = {s}  scheduler block: the lcm of the effective block sizes", file=out)
    print(f"H = {h}  hash block: tokens per chained hash", file=out)
    print(
        f"partial hits: {'on' if planner.partial_hits else 'off'}; "
        f"lookups and tail boundaries land on multiples of {planner.alignment} tokens",
        file=out,
    )
    print("\n  #  kind             block  effective  hashes/block  takes part", file=out)
    for i, g in enumerate(groups):
        eff = g.block_size if g.kind == "mamba" else g.block_size * dcp
        takes = per_block[i] > 0
        extra = f" window={g.window}" if g.window else ""
        extra += f" mode={g.mamba_mode}" if g.kind == "mamba" else ""
        print(
            f"  {i}  {g.kind:<15}  {g.block_size:>5}  {eff:>9}  {per_block[i]:>12}  "
            f"{'yes' if takes else 'no '} ({_participation_reason(g, takes, any_cacheable)}){extra}",
            file=out,
        )
    skipped = [i for i in range(len(groups)) if per_block[i] == 0]
    for i in skipped:
        g = groups[i]
        eff = g.block_size if g.kind == "mamba" else g.block_size * dcp
        if eff % h:
            print(
                f"\nvLLM note: group {i} ({g.kind}, {eff} tokens) is not a multiple of H={h}. vLLM's "
                f"OffloadingConnector asserts 'tokens_per_block={eff} not divisible by tokens_per_hash={h}' "
                "at boot (before PR 55037), then hits islice(step=0) on the first request (before PR 55034). "
                "kvstride gives it 0 hashes per block and never keys, stores, looks up or loads it.",
                file=out,
            )
    hasher = _core.BlockHasher(args.algo, seed=args.seed)
    tokens = list(range(1, 2 * s + 1))
    hashes = hasher.hash_blocks(tokens, h)
    tables = [list(range(1, 2 * s // (g.block_size if g.kind == "mamba" else g.block_size * dcp) + 1)) for g in groups]
    plan = planner.plan_save(hashes, tables, len(tokens))
    print(f"\nsample keys: a {len(tokens)}-token request ({args.algo}, seed {args.seed!r})", file=out)
    shown = {}
    for key, group, block_id in plan.puts:
        if shown.get(group, 0) < 2:
            shown[group] = shown.get(group, 0) + 1
            print(f"  group {group} block {block_id}: {key}", file=out)
    for i, g in enumerate(groups):
        if per_block[i] and g.kind == "mamba":
            print(
                f"  group {i} (mamba): stored only from the scheduler's boundary hand-offs "
                "(its block table is never read positionally)",
                file=out,
            )
    return 0


# ---- simulate ----------------------------------------------------------------------------


def simulate(mix: Mix, args) -> int:
    import json

    if getattr(args, "trace", None):
        return simulate_trace(args)

    from kvstride.simulate import SimConfig, plot, print_table, run_simulation

    sizes, error = _try_resolve(mix.groups, mix.prefix_match_unit, args.dcp)
    if sizes is None:
        print(f"kvstride simulate: this mix cannot be keyed: {error}\n(run kvstride explain for mixes that work)", file=sys.stderr)
        return 2
    if not str(args.seed).isdigit():
        print(f"kvstride simulate: --seed {args.seed!r}: the workload's seed is a whole number >= 0", file=sys.stderr)
        return 2
    remote = args.store.startswith("mooncake://")
    # A store of its own holds the values; a client of another's (store serve) holds none.
    store_bytes = args.store_bytes if args.store_bytes is not None else 0 if remote else 1 << 30
    if store_bytes == 0 and not remote:
        print(f"kvstride simulate: --store-bytes 0: the {args.store} store needs room; give a size > 0 such as 1G",
              file=sys.stderr)
        return 2
    cfg = SimConfig(
        mix=mix,
        conversations=args.conversations,
        batch=args.batch,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        reply_tokens=args.reply_tokens,
        token_bytes=args.token_bytes,
        state_bytes=args.state_bytes,
        store=args.store,
        store_bytes=store_bytes,
        disk_path=args.disk_path,
        disk_bytes=args.disk_bytes or 0,
        algo=args.algo,
        seed=int(args.seed),
        dcp=args.dcp,
        fault_every=args.fault_every,
        chunk_tokens=args.chunk_tokens,
        load_timing=args.load_timing,
        progress=not args.json and not args.quiet,
    )
    if args.store != "embedded":
        from kvstride.stores.mooncake_master import mooncake_missing

        missing = mooncake_missing()
        if missing:  # one line, before anything is said about the store it would start
            print(f"kvstride simulate: --store {args.store}: {missing}", file=sys.stderr)
            return 2
        print(f"kvstride simulate: {MOONCAKE_START_LINES}", file=sys.stderr, flush=True)
    try:
        result = run_simulation(cfg)
    except (ValueError, OSError) as err:  # the store could not be set up as asked
        print(f"kvstride simulate: {err}", file=sys.stderr)
        return 2
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0 if result["verified"] else 1


def simulate_trace(args) -> int:
    """``simulate --trace FILE``: replay a Mooncake-format trace per policy x capacity."""
    import json

    from kvstride.capacity import DISK_POLICIES
    from kvstride.simulate import DEFAULT_TRACE_CAPACITIES, plot_trace, print_trace_table, run_trace

    model = args.model
    capacities = [c for sizes in (args.capacity or []) for c in sizes]
    policy = args.policy or "kvstride"

    def said(result: dict) -> None:  # --quiet: a line a finished replay, not a progress bar
        tier = f" over a {result['disk']} disk ({result['disk_policy']})" if result.get("disk_bytes") else ""
        print(f"kvstride simulate --trace: {result['policy']} at {result['capacity']}{tier}: "
              f"{result['token_hit_rate']:.1%} of prompt tokens hit ({result['seconds']:.0f} s)", file=sys.stderr)

    try:
        results = run_trace(
            args.trace,
            model=model,
            capacities=capacities or list(DEFAULT_TRACE_CAPACITIES),
            policies=[policy] if policy != "all" else None,
            progress=not args.json and not args.quiet,
            limit=args.limit,
            disk_bytes=args.disk_bytes or 0,
            disk_policies=DISK_POLICIES if args.disk_policy in (None, "both") else [args.disk_policy],
            hedge_tokens=args.hedge_tokens,
            checkpoints=args.checkpoints,
            retention_interval=args.retention_interval,
            decode_states=args.decode_states,
            value_weight=args.value_weight,
            on_result=said if args.quiet and not args.json else None,
        )
    except (OSError, ValueError) as err:
        print(f"kvstride simulate --trace: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"trace": args.trace, "results": results}))
    else:
        print_trace_table(results)
    truncated = max((r.get("truncated_inputs", 0) for r in results), default=0)
    if truncated:
        print(f"kvstride simulate --trace: {truncated} requests have an input_length longer than their hash_ids "
              "cover; each was replayed as long as its hash_ids", file=sys.stderr)
    if args.plot:
        plot_trace(results, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0 if all(r["unservable_hits"] == 0 for r in results) else 1


# ---- bench -----------------------------------------------------------------------------------

#: The benches ``kvstride bench`` runs, each printing a markdown table with its ratio column:
#: (script, its --quick arguments, the modules it needs).
BENCHES = (
    ("keypath.py", ["--repeat", "5"], ("cbor2",)),
    ("transfer.py", ["--threads", "1", "--reps", "7"], ()),
    ("save_step.py", ["--reps", "3", "--steps", "300"], ()),
    ("store.py", ["--reps", "5"], ("mooncake.store",)),
    ("arena.py", ["--repeat", "5"], ()),
    ("engine.py", ["--repeat", "7"], ()),
)

#: How to install what a bench needs (after ``make simulate``, the demo's packages alone).
INSTALLS = {"cbor2": "pip install cbor2", "mooncake.store": f"{MOONCAKE_PIP} (and Debian's libibverbs1)"}


def _importable(module: str) -> bool:
    """``module`` imports in this Python (tried in a child: Mooncake's client loads native libraries)."""
    import subprocess

    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def bench(args) -> int:
    """Run the benches of a source checkout, each next to its baseline in the same run."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    benches = root / "benches"
    if not (benches / "keypath.py").exists():
        print("kvstride bench runs the benches of a source checkout (benches/ next to python/); "
              "clone the repository and run `make bench`", file=sys.stderr)
        return 2
    env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"), PYTHONPATH=str(benches) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    failed = 0
    if args.rust:
        print("## cargo bench --bench core\n", flush=True)
        failed |= subprocess.call(["cargo", "bench", "--bench", "core"], cwd=root) != 0
    importable = {module: _importable(module) for _, _, needs in BENCHES for module in needs}
    mooncake = importable["mooncake.store"]  # store.py needs it: asked above
    for script, quick, needs in BENCHES:
        print(f"\n## benches/{script}\n", flush=True)
        missing = [module for module in needs if not importable[module]]
        if missing:
            print(f"skipped: needs {', '.join(missing)}, which is not installed: "
                  f"{'; '.join(INSTALLS.get(m, 'pip install ' + m) for m in missing)}", flush=True)
            continue
        extra = list(quick) if args.quick else []
        if script == "engine.py" and not mooncake:  # its Mooncake rows need the client
            print(f"(the Mooncake rows are left out: {MOONCAKE_PIP} adds them)", flush=True)
            extra += ["--stores", "embedded"]
        failed |= subprocess.call([sys.executable, str(benches / script), *extra], cwd=root, env=env) != 0
    return 1 if failed else 0


# ---- store serve ---------------------------------------------------------------------------


def _write_atomically(path: str, text: str) -> None:
    """Readers polling ``path`` see no file or the whole file, never half of it."""
    import os

    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        f.write(text + "\n")
    os.replace(partial, path)


def _report_sockets(master, holder) -> None:
    """Print what the master and this process (the segment holder) listen on, measured from the
    kernel's socket tables (kvstride.exposure), one JSON line then a warning for wildcard ones."""
    import json
    import os

    from kvstride.exposure import describe, listening_sockets

    sockets = {"mooncake_master": listening_sockets(master.pid), "segment_holder": listening_sockets()}
    shown = {who: [str(s) for s in found] for who, found in sockets.items()}
    print(f"kvstride store: listening sockets (measured): {json.dumps(shown)}", file=sys.stderr, flush=True)
    wild = [f"{s} ({who}, pid {master.pid if who == 'mooncake_master' else os.getpid()})"
            for who, found in sockets.items() for s in found if s.wildcard]
    if wild:
        print(
            f"kvstride store: WARNING: {', '.join(wild)} listen on all interfaces whatever --host says: Mooncake's "
            "TCP transport binds its data port to [::] (dual-stack) and its handshake port to 0.0.0.0 and offers no "
            "option to bind one address. Whoever reaches them can read and write any memory of that process: run the "
            "store and the engines on an isolated network or behind a firewall (docs/OPERATING.md: Trust model). "
            f"All: {describe(sockets['segment_holder'])}",
            file=sys.stderr,
            flush=True,
        )


#: ``kvstride store serve``'s mooncake_master --client_ttl (seconds).
STORE_SERVE_CLIENT_TTL_S = 60


def _positive_seconds(text: str) -> int:
    try:
        seconds = int(text)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds > 0, got {text!r}")
    return seconds


def _unbindable(host: str) -> Optional[str]:
    """Why this host cannot listen on ``host`` (not one of its addresses, or not an address),
    or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as err:
        return f"not an address ({err.strerror or err})"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(address)
        except OSError as err:
            return f"not an address of this host ({err.strerror or err})"
    return None


def store_serve(args) -> int:
    """Run ``mooncake_master`` plus one client that holds ``--bytes`` of segment, so that engines
    can be pure clients (segment 0) whose objects outlive them; stop on SIGINT / SIGTERM."""
    import json
    import os
    import signal
    import threading

    from kvstride.mooncake_config import MooncakeClientConfig
    from kvstride.sizes import parse_size
    from kvstride.stores import MooncakeStore, start_master

    try:
        segment_bytes = parse_size(args.bytes, "--bytes")
    except ValueError as err:
        print(f"kvstride store serve: {err}", file=sys.stderr)
        return 2
    if segment_bytes == 0:
        print("kvstride store serve: --bytes must be > 0: the objects live in this segment", file=sys.stderr)
        return 2
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if segment_bytes >= memory:
        print(f"kvstride store serve: --bytes {args.bytes} is not less than this host's memory "
              f"({memory / 2**30:.1f} GiB): give a smaller segment", file=sys.stderr)
        return 2
    if args.host in ("", "0.0.0.0", "::"):
        print(
            f"kvstride store serve: --host {args.host!r} is a wildcard; give an address the engines "
            "can reach (127.0.0.1 or this machine's IP)",
            file=sys.stderr,
        )
        return 2
    problem = _unbindable(args.host)
    if problem:
        print(f"kvstride store serve: --host {args.host}: {problem}; give an address of this host "
              "(127.0.0.1 or this machine's IP)", file=sys.stderr)
        return 2
    secret_folder = os.path.dirname(os.path.abspath(args.secret_file)) if args.secret_file else None
    if secret_folder and not os.path.lexists(args.secret_file) and not os.path.isdir(secret_folder):
        print(f"kvstride store serve: --secret-file {args.secret_file}: the folder {secret_folder} does not exist; "
              f"create it first (mkdir -p {secret_folder}) or give another path", file=sys.stderr)
        return 2
    secret_note = None
    if args.secret_file:
        from kvstride.secret import generate_secret_file, load_secret

        try:
            if os.path.lexists(args.secret_file):
                load_secret(args.secret_file)  # refuses a weak or group/other-readable key
                secret_note = f"using the existing key in {args.secret_file}"
            else:
                generate_secret_file(args.secret_file)
                secret_note = f"generated a new key in {args.secret_file} (mode 0600)"
        except (ValueError, OSError) as err:
            print(f"kvstride store serve: --secret-file: {err}", file=sys.stderr)
            return 2
    stop = threading.Event()
    # Installed before anything starts, so that a signal during start-up still shuts down cleanly.
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    master = holder = None
    try:
        # Warnings and errors only: at INFO the master logs a metrics line every 10 s, forever.
        # The holder below lives and dies with this master, so a missed heartbeat (a busy host)
        # must not make the master drop the holder's segment and every object in it.
        master = start_master(
            host=args.host, rpc_port=args.port, client_ttl_s=args.client_ttl,
            lease_ttl_ms=None if args.lease_ttl is None else args.lease_ttl * 1000, extra_args=["--minloglevel=1"],
            log_dir=args.log_dir,
        )
        holder = MooncakeStore(master, segment_bytes=segment_bytes, local_hostname=args.host)
        engine_config = json.dumps(MooncakeClientConfig(master.address, global_segment_size=0).to_json())
        if args.config_out:
            _write_atomically(args.config_out, engine_config)
        print(engine_config, flush=True)
        where = f"MOONCAKE_CONFIG_PATH={args.config_out}" if args.config_out else "MOONCAKE_CONFIG_PATH=<the JSON above>"
        print(
            f"kvstride store: holding {segment_bytes} B for master {master.address} (log: {master.log_path}); "
            f"engines: {where}; stop with Ctrl-C or SIGTERM",
            file=sys.stderr,
            flush=True,
        )
        _report_sockets(master, holder)
        print(f"kvstride store: {MOONCAKE_START_LINES}", file=sys.stderr, flush=True)
        if secret_note:
            extra = json.dumps({"store": "mooncake", "secret_file": os.path.abspath(args.secret_file)})
            print(
                f"kvstride store: secret: {secret_note}. Copy it (mode 0600) to every engine host and add "
                f"\"secret_file\" to each engine's kv_connector_extra_config, e.g. {extra}: with it, store keys "
                "cannot be computed and values cannot be forged without the key. This process does not need it.",
                file=sys.stderr,
                flush=True,
            )
        while not stop.wait(1.0):
            if not master.alive():
                print(
                    f"kvstride store serve: mooncake_master exited with {master.proc.returncode}; log: {master.log_path}",
                    file=sys.stderr,
                )
                return 1
        return 0
    except (RuntimeError, ValueError, OSError) as err:
        print(f"kvstride store serve: {err}", file=sys.stderr)
        return 1
    finally:
        if holder is not None:
            holder.close()  # before the master: closing against a stopped master takes ~10 s
        if master is not None:
            master.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- entry point -----------------------------------------------------------------------------

# Modules of the `cli` extra: a command that needs a missing one says what to install.
_CLI_EXTRA_MODULES = ("torch", "tqdm", "matplotlib")


def _version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstride")
    except PackageNotFoundError:  # run from a source tree without an install
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstride", description=__doc__.replace("``", ""))
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    explain_parser = commands.add_parser("explain", help="S, H, participation and keys of a group mix")
    _mix_arguments(explain_parser)
    sim = commands.add_parser("simulate", help="replay a multi-turn chat workload through the offload engine")
    _mix_arguments(sim)
    sim.add_argument("--store", type=_store_url, default="embedded",
                     help="embedded | mooncake (starts a master on loopback) | mooncake://HOST:PORT")
    sim.add_argument("--conversations", type=_POSITIVE, default=8, help="chats replayed side by side")
    sim.add_argument("--turns", type=_POSITIVE, default=4, help="user messages per chat")
    sim.add_argument("--batch", type=_POSITIVE, default=4, help="requests per engine step")
    sim.add_argument("--system-tokens", type=_NON_NEGATIVE, default=2048, help="shared system prompt length")
    sim.add_argument("--user-tokens", type=_POSITIVE, default=300, help="tokens each user message adds")
    sim.add_argument("--reply-tokens", type=_NON_NEGATIVE, default=200, help="tokens each reply adds")
    sim.add_argument("--token-bytes", type=_POSITIVE, default=64, help="KV bytes per token per attention group")
    sim.add_argument("--state-bytes", type=_POSITIVE, default=16384, help="bytes of one Mamba state")
    sim.add_argument("--store-bytes", type=_size, default=None,
                     help="store capacity, a size such as 1G or 512MiB (default 1G; with mooncake://HOST:PORT 0: a "
                     "pure client of that store, as against kvstride store serve)")
    sim.add_argument(
        "--fault-every",
        type=_NON_NEGATIVE,
        default=0,
        help="before every N-th batch of requests corrupt values, restart or evict the store (in turn)",
    )
    sim.add_argument(
        "--chunk-tokens",
        type=_POSITIVE,
        default=1024,
        help="prefill chunk size (rounded up to the lookup alignment, at least S); Mamba states "
        "are handed off at chunk ends",
    )
    sim.add_argument(
        "--load-timing",
        choices=("async", "sync"),
        default="async",
        help="async: a hit's load completes before its first computing step (the connector); "
        "sync: in that step, after vLLM's Mamba running-state copy (the old, wrong order)",
    )
    sim.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a Mooncake-format trace (JSON lines with input_length and hash_ids of 512-token "
        "blocks; gzip if FILE ends in .gz) through the core and a capacity index; --model picks a geometry "
        "(python/kvstride/models/*.json, default qwen3-next-80b)",
    )
    sim.add_argument(
        "--capacity",
        action="append",
        type=_capacities,
        metavar="SIZE",
        help="with --trace: store capacity, e.g. 256G or 1T (binary units; repeat or comma-separate; "
        "default 256G,1T,4T,16T)",
    )
    sim.add_argument(
        "--policy",
        default=None,
        choices=("dense", "vllm-reachable", "kvstride", "all", "kvstride-admission", "kvstride-boundary-sets"),
        help="with --trace: dense | vllm-reachable | kvstride (default) | all; ablations of kvstride's "
        "eviction, not in all: kvstride-admission (per-value LRU), kvstride-boundary-sets (BoundaryIndex)",
    )
    sim.add_argument("--limit", type=_POSITIVE, default=None, help="with --trace: replay only the first N requests")
    sim.add_argument(
        "--checkpoints",
        type=_checkpoints,
        default="connector",
        help="with --trace, kvstride policies: where states are checkpointed: connector (the connector's "
        "own rule, default), or a comma list of end (the prompt end), hedge (the last boundary "
        "--hedge-tokens before it), junction (the deepest prefix seen before), every:T (every T tokens)",
    )
    sim.add_argument(
        "--retention-interval",
        type=_NON_NEGATIVE,
        default=16384,
        help="with --trace, --checkpoints connector: vLLM's prefix_cache_retention_interval (periodic "
        "checkpoints every this many tokens; 0: none, vLLM's default)",
    )
    sim.add_argument(
        "--value-weight",
        type=_non_negative_float,
        default=PrefixOrder.VALUE_WEIGHT,
        help="with --trace, policy kvstride: how much the prefill a request's hit saves per byte counts "
        "against recency in the eviction order (default %(default)s; 0: recency and reads alone)",
    )
    sim.add_argument(
        "--hedge-tokens",
        type=_NON_NEGATIVE,
        default=512,
        help="with --trace, --checkpoints hedge: the last boundary this many tokens before the prompt end",
    )
    sim.add_argument(
        "--disk-bytes",
        type=_disk_size,
        metavar="SIZE",
        help="a local disk of SIZE below the store's memory, e.g. 4T (binary units): with --trace, policy kvstride, "
        "each capacity is also replayed over it (hit rate, disk bytes written and read per request); without, "
        "the embedded store writes through to records in --disk-path",
    )
    sim.add_argument("--disk-path", type=_disk_folder, metavar="DIR",
                     help="with --disk-bytes (not --trace): the embedded store's disk tier's folder (its records "
                     "and index stay there, and a later run on it hits them)")
    sim.add_argument(
        "--disk-policy",
        choices=("write-through", "spill", "both"),
        default=None,
        help="with --disk-bytes: write-through (every value memory stores is written to disk at once), spill (a value "
        "goes to disk when memory evicts it) or both (default)",
    )
    sim.add_argument(
        "--decode-states",
        action="store_true",
        help="with --trace: model a vLLM that hands off the state at each request's decode end, so a "
        "next turn can hit past the previous prompt (vLLM 0.32 and 0.33 hand off none)",
    )
    sim.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    sim.add_argument("--plot", metavar="FILE.png", type=_writable_path(".png"),
                     help="draw hit rate and throughput per turn (with --trace: hit rate per capacity)")
    sim.add_argument("--quiet", action="store_true",
                     help="no progress bar; with --trace, one line on stderr as each replay ends")
    parser.simulate_parser = sim  # its defaults tell which options were given (_mode_mismatch)
    bench_parser = commands.add_parser("bench", help="run the core and data-plane benches and print their ratio tables")
    bench_parser.add_argument("--quick", action="store_true", help="fewer repeats")
    bench_parser.add_argument("--rust", action="store_true", help="also run the criterion benches (cargo bench)")
    check = commands.add_parser(
        "check-config",
        help="check a --kv-transfer-config offline, with the errors the connector raises at start-up",
    )
    check.add_argument("config", help="the JSON given to vLLM's --kv-transfer-config, or @FILE holding it")
    check.add_argument("--model", help="the model vLLM serves (a checkpoint folder, its config.json or a cached "
                       "Hugging Face id): also check that kvstride can key its groups, and print its lookup alignment")
    store_parser = commands.add_parser("store", help="a Mooncake store that outlives the engines")
    store_commands = store_parser.add_subparsers(dest="store_command", required=True)
    serve = store_commands.add_parser(
        "serve",
        help="start mooncake_master and one client holding the segment; print the engines' config (segment 0)",
    )
    serve.add_argument("--bytes", required=True, help="segment held for the engines' objects, e.g. 8G, 512MB")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the master's RPC and metrics ports bind and the engines are given (default: 127.0.0.1). "
        "Mooncake's segment holder still listens on all interfaces (its TCP data port on [::], its handshake port "
        "on 0.0.0.0; no option binds one address): the command prints the sockets it measures",
    )
    serve.add_argument("--port", type=_int_at_least(1), default=None, help="master RPC port (default: a free one)")
    serve.add_argument("--config-out", metavar="PATH", type=_writable_path(),
                       help="also write the engines' config here (for MOONCAKE_CONFIG_PATH)")
    serve.add_argument(
        "--client-ttl",
        type=_positive_seconds,
        default=STORE_SERVE_CLIENT_TTL_S,
        metavar="SECONDS",
        help="how long the master keeps a client's segment, and every object in it, without a heartbeat "
        f"(mooncake_master --client_ttl; default: {STORE_SERVE_CLIENT_TTL_S}, where Mooncake's 10 lost the holder's "
        "objects whenever a busy host delayed its heartbeat)",
    )
    serve.add_argument(
        "--lease-ttl",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="how long a read may take before Mooncake fails it as LEASE_EXPIRED, which the engine counts and "
        "recomputes (mooncake_master --default_kv_lease_ttl; default: Mooncake's 10). A read holds its object "
        "against eviction that long. Raise it with the engines' load_timeout_s, which ends a load before then",
    )
    serve.add_argument(
        "--log-dir",
        metavar="DIR",
        help="keep mooncake_master's log (warnings and errors) in DIR (default: a temporary folder removed at exit)",
    )
    serve.add_argument(
        "--secret-file",
        metavar="PATH",
        help="the deployment key (created with mode 0600 when missing): engines that name it in "
        "kv_connector_extra_config['secret_file'] key and MAC what they store with it",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    import os

    # Mooncake's C++ client logs every connection step at INFO; keep the command's output readable.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from kvstride.mooncake_config import MooncakeDependencyError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except BrokenPipeError:  # the reader stopped early (| head): end quietly, as a shell tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush would raise again
        return 141  # 128 + SIGPIPE
    except MooncakeDependencyError as err:  # what Mooncake needs and how to install it, no traceback
        print(f"kvstride {args.command}: {err}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as err:
        module = (err.name or "").partition(".")[0]
        if module not in _CLI_EXTRA_MODULES:
            raise
        print(f"kvstride {args.command} needs {module}, which is not installed: pip install {' '.join(_CLI_EXTRA_MODULES)}",
              file=sys.stderr)
        return 2


def check_config(parser: argparse.ArgumentParser, args, out=None) -> int:
    """``kvstride check-config``: the connector's checks that need no engine (``connector_checks``),
    on this host (the disk tier's folder, the Mooncake client's file), and with ``--model`` the
    geometry kvstride keys; one line and exit 2 on the first error."""
    import json

    from kvstride.connector_checks import check_transfer_config

    out = out if out is not None else sys.stdout
    text = args.config
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as err:
            parser.error(f"{args.config}: {err.strerror or err}")
    try:
        extra = check_transfer_config(json.loads(text))
    except json.JSONDecodeError as err:
        parser.error(f"the configuration is not JSON ({err}); give the --kv-transfer-config value in single quotes")
    except ValueError as err:
        parser.error(str(err))
    store = str(extra.get("store", "embedded"))
    tier = f", a disk tier in {extra['disk_path']}" if "disk_path" in extra else ""
    key = ", keyed and authenticated with its secret_file" if extra.get("secret_file") else ""
    print(f"ok: the {store} store{tier}{key}", file=out)
    if args.model:
        try:
            mix = model_mix(args.model)
        except ValueError as err:
            parser.error(str(err))
        sizes, error = _try_resolve(mix.groups, None, 1)
        if sizes is None:
            parser.error(f"--model {args.model}: kvstride cannot key its groups: {error}")
        print(f"ok: {mix.name} ({format_groups(mix.groups)}): hits are whole multiples of {sizes[1]} tokens",
              file=out)
    return 0


#: ``simulate`` options that only the trace replay reads, and those only the chat workload reads.
TRACE_ONLY = ("capacity", "policy", "limit", "checkpoints", "retention_interval", "value_weight", "hedge_tokens",
              "decode_states", "disk_policy")
WORKLOAD_ONLY = ("store", "conversations", "turns", "batch", "system_tokens", "user_tokens", "reply_tokens",
                 "token_bytes", "state_bytes", "store_bytes", "fault_every", "chunk_tokens", "load_timing", "disk_path")


#: What Mooncake's client prints at every start, explained once by the commands that start one.
MOONCAKE_START_LINES = (
    "Mooncake's client prints 'Logging before InitGoogleLogging' and 'Local segment descriptor not found' at "
    "every start (it looks up its own segment before it publishes it): expected, not an error"
)


def _mode_mismatch(sim: argparse.ArgumentParser, args) -> Optional[str]:
    """An option given (not at its default) that the chosen mode would ignore, as an error."""
    trace = bool(args.trace)
    ignored = WORKLOAD_ONLY if trace else TRACE_ONLY
    given = [name for name in ignored if getattr(args, name) != sim.get_default(name)]
    if not given:
        return None
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    if trace:
        return f"{flags}: not read by --trace (a replay through the core and a capacity index); leave it out"
    return f"{flags}: only read by --trace FILE; add --trace or leave it out"


def _run(parser: argparse.ArgumentParser, args) -> int:
    if args.command == "bench":
        return bench(args)
    if args.command == "store":
        return store_serve(args)
    if args.command == "check-config":
        return check_config(parser, args)
    if args.command == "simulate" and args.trace and (args.preset or args.groups):
        parser.error("--trace replays a model's geometry: name it with --model (not --preset or --groups)")
    if args.command == "simulate":
        mismatch = _mode_mismatch(parser.simulate_parser, args)
        if mismatch:
            parser.error(mismatch)
        if not getattr(args, "trace", None) and (args.disk_path is None) != (args.disk_bytes is None):
            parser.error("--disk-bytes and --disk-path go together without --trace (the embedded store's disk tier: "
                         "a folder and its size), e.g. --disk-path /nvme/kvstride --disk-bytes 64G")
        if getattr(args, "disk_path", None) and args.store != "embedded":
            parser.error(f"--disk-path: the disk tier is the embedded store's; use --store embedded (not {args.store})")
        if args.disk_policy and not args.disk_bytes:
            parser.error("--disk-policy: only read with --disk-bytes SIZE (a disk below memory); add it or leave "
                         "--disk-policy out")
        if args.disk_bytes and args.policy not in (None, "kvstride"):
            parser.error(f"--disk-bytes: the disk tier is modelled below the kvstride policy's memory only; use "
                         f"--policy kvstride (not {args.policy}) or leave --disk-bytes out")
    if args.model and (args.preset or args.groups):
        parser.error("--model gives the geometry: leave out --preset and --groups, or --model")
    if args.groups is not None and not args.groups.strip():
        parser.error('--groups is empty: give a group mix, e.g. "full_attention:16,mamba:64", or leave it out')
    try:
        mix = model_mix(args.model, args.prefix_match_unit) if args.model else resolve_mix(
            args.preset, args.groups, args.prefix_match_unit)
    except ValueError as err:
        parser.error(str(err))
    if args.command == "explain":
        return explain(mix, args)
    if args.command == "simulate":
        return simulate(mix, args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
