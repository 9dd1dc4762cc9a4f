"""Sphinx extension: the scoreboard appendix's tables and roofline, built from book/data/*_bench.json.

The page (book/scoreboard.md) places four directives; each turns benchmarks/scoreboard.py's tables
into docutils nodes when the page is read, so rebuilding the book after scripts/gpu_benchmarks.sh
shows the new results:

    ```{scoreboard-sources}        the stored runs: file, device, the tables that read it
    ```{scoreboard-bars}           the issues' bars, each against the worst case measured
    ```{scoreboard} ssd            one topic's tables (a key of scoreboard.TOPICS), each with its verdict
    ```{scoreboard-roofline}       the roofline figure, drawn into book/_generated/ (ignored by git)

Every data file is noted as a dependency of the page, so an incremental build re-reads the page
when a benchmark run changes one.
"""
import pathlib
import sys

from docutils import nodes
from docutils.parsers.rst import Directive

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import scoreboard  # noqa: E402

FIGURE = "book/_generated/scoreboard_roofline.png"  # relative to the book's source folder


def paragraph(text):
    return nodes.paragraph(text=text)


def table_nodes(table):
    """The title (a paragraph above the table, not a caption: a caption would scroll sideways with a
    wide table), the table, the device and file it comes from, and its verdict sentences."""
    title = nodes.paragraph()
    title += nodes.strong(text=table.title)
    grid = nodes.table(classes=["scoreboard"])
    group = nodes.tgroup(cols=len(table.columns))
    grid += group
    group.extend(nodes.colspec(colwidth=1) for _ in table.columns)

    def row(values):
        line = nodes.row()
        for value in values:
            entry = nodes.entry()
            entry += nodes.paragraph(text=str(value))
            line += entry
        return line

    head, body = nodes.thead(), nodes.tbody()
    head += row(table.columns)
    body.extend(row(values) for values in table.rows)
    group += head
    group += body
    source = []
    if "*" not in table.source:  # one run's table (the list of runs names each file and device itself)
        source = [nodes.paragraph()]
        source[0] += nodes.Text(f"Measured on the {table.device}; ")
        source[0] += nodes.literal(text=f"book/data/{table.source}")
        source[0] += nodes.Text(".")
    return [title, grid, *source, *(paragraph(sentence) for sentence in table.verdict)]


class _DataDirective(Directive):
    def note_data(self):
        env = self.state.document.settings.env
        for path in sorted(scoreboard.DATA.glob("*.json")):
            env.note_dependency(str(path))
        # the sources table says whether the package changed after each run: rebuild when it does
        for path in sorted((scoreboard.DATA.parent.parent / "mamba_annotated").rglob("*.py")):
            env.note_dependency(str(path))
        return env


class ScoreboardSources(_DataDirective):
    def run(self):
        self.note_data()
        return table_nodes(scoreboard.sources())


class ScoreboardBars(_DataDirective):
    def run(self):
        self.note_data()
        return table_nodes(scoreboard.issue_bars())


class ScoreboardTopic(_DataDirective):
    required_arguments = 1

    def run(self):
        self.note_data()
        topic = self.arguments[0]
        if topic not in scoreboard.TOPICS:
            raise self.error(f"unknown scoreboard topic {topic!r}; known: {sorted(scoreboard.TOPICS)}")
        return [node for table in scoreboard.tables(topic) for node in table_nodes(table)]


class ScoreboardRoofline(_DataDirective):
    def run(self):
        env = self.note_data()
        path = pathlib.Path(env.srcdir) / FIGURE
        path.parent.mkdir(parents=True, exist_ok=True)
        left_out = scoreboard.plot_roofline(path)
        out = [nodes.image(uri="/" + FIGURE, alt="the book's kernels and their peers on the measured roofline",
                           classes=["scoreboard-roofline"])]
        if left_out:
            out.append(paragraph(f"Not plotted: the runs made on the {', '.join(left_out)}, because no stored run "
                                 "measured both a copy bandwidth and a matmul rate on that GPU to draw its roofs."))
        return out


def setup(app):
    app.add_directive("scoreboard-sources", ScoreboardSources)
    app.add_directive("scoreboard-bars", ScoreboardBars)
    app.add_directive("scoreboard", ScoreboardTopic)
    app.add_directive("scoreboard-roofline", ScoreboardRoofline)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
