"""The book's one colour code, used by every figure: input x, state h, output y, carries."""

COLORS = {
    "x": "#1f77b4",      # input: blue
    "h": "#ff7f0e",      # state: orange
    "y": "#2ca02c",      # output: green
    "carry": "#d62728",  # carries between blocks / chunks: red
    "decay": "#7f7f7f",  # decays a, A-bar: grey
}


def show_source(obj):
    """Display the source of a function or Triton kernel as a highlighted code block."""
    import inspect

    from IPython.display import Markdown

    fn = obj
    while hasattr(fn, "fn"):  # @triton.autotune wraps a @triton.jit kernel, which wraps the function
        fn = fn.fn
    return Markdown(f"```python\n{inspect.getsource(fn)}```")
