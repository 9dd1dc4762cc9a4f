"""Import the peer implementations the benchmarks time against, where they are installed.

Install them with pip (mamba-ssm==2.3.2.post1, accelerated-scan, mambapy, flash-linear-attention);
on the offline GPU box they come as wheels. mamba_ssm's package __init__ imports its CUDA
extensions, which its pure-Python wheel lacks (and which the benchmarks do not need: they time its
Triton kernels), so mamba_ssm is registered as a package whose __init__ is not run, and its
submodules are imported from it. Each loader returns None, with a printed reason, when its peer is
missing.
"""
import importlib
import importlib.util
import sys
import types


def _import(name):
    try:
        return importlib.import_module(name)
    except Exception as e:  # a peer that fails to import is reported, not fatal
        print(f"peer {name} unavailable: {type(e).__name__}: {e}")
        return None


def mamba_ssm_module(submodule: str):
    """e.g. mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")."""
    if "mamba_ssm" not in sys.modules:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None:
            print("peer mamba_ssm unavailable: not installed")
            return None
        # the package's module without its __init__: a submodule import finds its files through
        # __path__, and Python runs no __init__ for a package already in sys.modules
        package = types.ModuleType("mamba_ssm")
        package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["mamba_ssm"] = package
    return _import(submodule)


def peer(name: str):
    """Any other peer by module name: accelerated_scan.triton, accelerated_scan.warp, mambapy.pscan, fla..."""
    return _import(name)


def mamba_ssm_selective_scan():
    """mamba_ssm's ``selective_scan_interface`` module and whether its CUDA kernel is there:
    (module or None, True if ``selective_scan_fn`` runs the compiled ``selective_scan_cuda``).

    The module imports the extension at the top. Where it is built (build_selective_scan_cuda.py,
    its folder on PYTHONPATH) the real one is imported first; otherwise an empty stand-in module
    lets the import through for the pure-PyTorch ``selective_scan_ref``, which never calls it.
    The extension counts as built only if it has its ``fwd``: an earlier stand-in, or a folder of
    that name on the path (imported as an empty namespace package), has not."""
    try:
        import selective_scan_cuda
        compiled = hasattr(selective_scan_cuda, "fwd")
    except ImportError:
        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        compiled = False
    interface = mamba_ssm_module("mamba_ssm.ops.selective_scan_interface")
    return interface, compiled and interface is not None


def autotuners(prefix: str) -> dict:
    """Every Triton autotuner of the imported modules whose name starts with ``prefix`` (for
    mamba_ssm's: "mamba_ssm."), by module and name; ours also where ``@lean_launch``
    (:mod:`mamba_annotated.launch`) wraps one, as it does on a GPU."""
    from triton.runtime.autotuner import Autotuner

    from mamba_annotated.launch import LeanLaunch

    return {f"{name}.{attr}": tuner for name, module in list(sys.modules.items())
            if name.startswith(prefix) and module is not None
            for attr, obj in list(vars(module).items())
            for tuner in (obj.kernel if isinstance(obj, LeanLaunch) else obj,) if isinstance(tuner, Autotuner)}


def cached_configs(tuners: dict) -> dict:
    """The configuration each autotuner of ``tuners`` (:func:`autotuners`) keeps for each key it has
    met, by autotuner and key (the key as Triton forms it: the values of the tuning key's arguments,
    then the dtype of every tensor argument), as strings: which configuration ran in which case."""
    return {name: {str(key): str(config) for key, config in tuner.cache.items()}
            for name, tuner in tuners.items() if tuner.cache}


def row_time(timed_ms: float, tunings_ms=None) -> dict:
    """A benchmark row's times: ``ms`` = ``timed_ms``; for a peer tuned by :func:`tune_fastest`
    (``tunings_ms``: its times after each tuning), ``ms`` is the least of ``timed_ms``, measured
    after the picks of its fastest tuning were put back, and that tuning's own time, with
    ``timed_ms`` kept as ``ms_after_picks_put_back``. Putting the picks back does not always bring
    the time back (book/data/ssd_bench.json: the first shape's forward and backward, against its
    ``peer_tunings``; the cause is not known). The row then shows the fastest time the peer was
    seen to take, which is the comparison the tunings are there for: the least of four medians
    where ours is one, a bias in the peer's favour."""
    if tunings_ms is None:
        return dict(ms=timed_ms)
    return dict(ms=min(timed_ms, *tunings_ms), ms_after_picks_put_back=timed_ms)


def tune_fastest(passes, tuners: dict, tunings: int = 3, time=None, picks=None) -> list:
    """Tune a peer's kernels ``tunings`` times for each of ``passes`` (callables, e.g. its forward,
    then its forward and backward) and keep, for each, the picks of the tuning that ran it fastest.

    A Triton autotuner times each configuration for a few milliseconds and keeps the fastest, so
    where configurations are close, or the kernel is short, its pick changes from one tuning to the
    next, and with it the peer's time: mamba_ssm's SSD at the benchmark's first shape took 3.08 to
    5.18 ms forward and backward over four tunings in one process (book/data/peer_tuning_probe.json).
    Timing the peer after its fastest of several tunings compares ours with the peer at its best.
    A pass keeps the picks of the passes before it (the forward's kernels are tuned once, with the
    forward) and retunes only the autotuners they left untouched. ``time(fn)`` gives ms (default
    :func:`mamba_annotated.bench.median_ms`, the median the benchmarks' rows report, so that a row
    can be read against the tunings' times). Returns the times of every tuning, one list per pass.
    With a list ``picks``, appends for each pass the configurations in every autotuner's cache after
    each tuning (``str`` of each config, by autotuner; those of earlier passes' autotuners too, whose
    keys first met in this pass are tuned here once): whether the tunings' times differ with their
    picks or without them."""
    if time is None:
        from mamba_annotated.bench import median_ms as time
    settled, times = set(), []
    for run in passes:
        best, tried, picked = None, [], []
        for _ in range(tunings):
            for name, tuner in tuners.items():
                if name not in settled:
                    tuner.cache.clear()
            run()  # tunes what the cleared autotuners meet
            tried.append(time(run))
            picked.append({name: [str(config) for config in tuner.cache.values()]
                           for name, tuner in tuners.items() if tuner.cache})
            if best is None or tried[-1] < best[0]:
                best = (tried[-1], {name: dict(tuner.cache) for name, tuner in tuners.items()})
        for name, tuner in tuners.items():
            tuner.cache.clear()
            tuner.cache.update(best[1][name])
        settled |= {name for name, cache in best[1].items() if cache}
        times.append(tried)
        if picks is not None:
            picks.append(picked)
    return times
