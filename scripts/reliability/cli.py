"""The one command-line rule every reliability step shares: a comma-separated list of names, each
one it knows (a light module: sanitize.py's parent process imports it without the package)."""


def comma_list(parser, value, allowed, option):
    """``value`` split at commas (blanks dropped); an unknown name is a usage error naming ``option``."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    unknown = sorted(set(items) - set(allowed))
    if unknown:
        parser.error(f"{option}: unknown {unknown}; known: {', '.join(allowed)}")
    return items
