"""Run a script the way `ray submit` runs it on a head node, on a machine that is the whole cluster.

    python tests/as_ray_submit.py SCRIPT [ARGS...]

`ray submit cluster.yaml train.py` uploads train.py to the head's home directory and runs
`python ~/train.py` there, as a plain driver (not a Ray job). Workers on other machines cannot see
that directory; here all nodes share one filesystem, so the script's directory is deleted as soon
as the driver has connected to Ray (which uploads what its runtime_env names). Whatever the workers
import from then on can only come from what Ray shipped to their node.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
from typing import Any

import ray


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    script_dir = os.path.dirname(script)
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, script_dir)  # what `python SCRIPT` does; runpy.run_path does not
    connect = ray.init

    def connect_then_hide_script_dir(*args: Any, **kwargs: Any) -> Any:
        context = connect(*args, **kwargs)
        shutil.rmtree(script_dir)
        return context

    ray.init = connect_then_hide_script_dir
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
