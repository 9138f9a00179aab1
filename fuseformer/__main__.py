"""``python -m fuseformer ...``: the ``fuseformer`` command, for environments without its script on PATH."""

from fuseformer.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
