"""The book's one colour code, used by every figure (input x, state h, output y, carries), and the
display of package source in the chapters: whole functions, or a fragment between two anchors."""
import inspect

COLORS = {
    "x": "#1f77b4",      # input: blue
    "h": "#ff7f0e",      # state: orange
    "y": "#2ca02c",      # output: green
    "carry": "#d62728",  # carries between blocks / chunks: red
    "decay": "#7f7f7f",  # decays a, A-bar: grey
}

# the four kinds of model compared in chapter 8, one colour each (none of the colours above)
MIXER_COLORS = {"transformer": "#9467bd", "mamba": "#8c564b", "mamba2": "#17becf", "hybrid": "#bcbd22"}


def python_function(obj):
    """The Python function under a Triton kernel's wrappers (@lean_launch, @triton.autotune and
    @triton.jit each keep the object they wrap as ``fn``), or ``obj`` itself."""
    while hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def source_of(obj) -> str:
    """The source text of a function or Triton kernel (:func:`python_function`)."""
    return inspect.getsource(python_function(obj))


def show_source(*objs):
    """Display the source of one or more functions or Triton kernels as one highlighted code block
    (several in one call, because Jupyter displays only the last expression of a cell)."""
    from IPython.display import Markdown

    return Markdown(f"```python\n{listing_of(*objs)}```")


def listing_of(*objs) -> str:
    """The sources of ``objs`` (:func:`source_of`), in order, a blank line between them."""
    if not objs:
        raise TypeError("show_source: give at least one function")
    return "\n".join(source_of(obj) for obj in objs)


def source_fragment(obj, start: str, end: str | None = None) -> str:
    """The lines of ``obj``'s source from the first line containing ``start`` up to, not including,
    the first later line containing ``end`` (to the end of the function when ``end`` is None).
    Anchors are text, not line numbers, so a fragment follows the code when lines move; an anchor
    that is missing or ambiguous raises, so a chapter cannot silently show the wrong lines."""
    lines = source_of(obj).splitlines()
    starts = [i for i, line in enumerate(lines) if start in line]
    if len(starts) != 1:
        raise ValueError(f"source_fragment: {start!r} occurs {len(starts)} times in {obj!r}; expected once")
    first = starts[0]
    last = len(lines)
    if end is not None:
        ends = [i for i, line in enumerate(lines) if end in line and i > first]
        if not ends:
            raise ValueError(f"source_fragment: {end!r} does not occur after {start!r} in {obj!r}")
        last = ends[0]
    return "\n".join(lines[first:last]) + "\n"


def show_fragment(obj, start: str, end: str | None = None):
    """Display :func:`source_fragment` as a highlighted code block."""
    from IPython.display import Markdown

    return Markdown(f"```python\n{source_fragment(obj, start, end)}```")
