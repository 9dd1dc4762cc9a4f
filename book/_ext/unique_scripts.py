"""Sphinx extension: write each page's scripts once.

sphinx-thebe and sphinx-togglebutton register inline scripts (`const THEBE_JS_URL = ...`) when the
sources are read, after the HTML builder has collected the registered scripts, so Sphinx 7 emits
those inline scripts twice and the second `const` throws a SyntaxError on every page (caught by
scripts/check_pages.py). This drops the repeats, keeping the first of each identical script.
"""


def _unique_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        attributes = getattr(script, "attributes", {})
        key = (str(getattr(script, "filename", script) or ""),  # None and "" both mean an inline script
               tuple(sorted((k, str(v)) for k, v in attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _unique_scripts, priority=900)  # after the themes' handlers
    return {"parallel_read_safe": True, "parallel_write_safe": True}
