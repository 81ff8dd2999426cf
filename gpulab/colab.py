"""The course's public address, in one place, the setup cell every notebook starts with, and whether a kernel runs on
Google Colab.

To move the course (a fork for a workshop), change REPOSITORY and run ``gpulab notebooks``: it
rewrites the setup cell of every notebook; a test checks that they agree.
"""

import importlib.util
import os

REPOSITORY = "https://github.com/gpulab-course/gpulab"
BRANCH = "main"

SETUP_CELL = f'''# Setup: in a checkout gpulab is already installed; on Colab this installs it (about a minute).
import importlib.util, subprocess, sys
if importlib.util.find_spec("gpulab") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gpulab @ git+{REPOSITORY}@{BRANCH}"], check=True)
import gpulab
device = gpulab.setup()'''


def colab_url(notebook: str) -> str:
    """The address that opens ``notebook`` (a path in the repository) on Colab."""
    return f"https://colab.research.google.com/github/{REPOSITORY.removeprefix('https://github.com/')}/blob/{BRANCH}/{notebook}"


def on_colab() -> bool:
    """Whether this Python runs in a Google Colab runtime (its environment names the release; its ``google.colab``
    package is importable)."""
    if os.environ.get("COLAB_RELEASE_TAG"):
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except ModuleNotFoundError:  # no package google at all
        return False
