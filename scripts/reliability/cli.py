"""What every reliability step shares on its command line and in its output: a comma-separated
list of names, each one it knows, and the JSON report that summary.py reads (a light module:
sanitize.py's parent process imports it without the package)."""
import json
from pathlib import Path


def comma_list(parser, value, allowed, option):
    """``value`` split at commas (blanks dropped); an unknown name is a usage error naming ``option``."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    unknown = sorted(set(items) - set(allowed))
    if unknown:
        parser.error(f"{option}: unknown {unknown}; known: {', '.join(allowed)}")
    return items


def write_report(path, item, ops, **fields):
    """A step's report ``{"item": item, **fields, "ops": ops}`` as JSON at ``path`` (None: nowhere)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(dict(item=item, **fields, ops=ops), indent=1))
