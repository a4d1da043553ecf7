#!/usr/bin/env bash
# Creates a virtual environment at DIR whose own packages come first and which then sees every package of PYTHON's
# environment (a venv's or the machine's), including editable installs (their .pth files are processed too).
set -euo pipefail
PYTHON="${1:?usage: nested_venv.sh PYTHON DIR}"
DIR="${2:?usage: nested_venv.sh PYTHON DIR}"
$PYTHON -m venv --without-pip "$DIR"  # pip, like everything else, comes from the active environment
OWN="$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
$PYTHON - "$OWN/zz_active_environment.pth" <<'PY'
import site
import sys
import sysconfig

paths = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
if site.ENABLE_USER_SITE:
    paths.append(site.getusersitepackages())
unique = list(dict.fromkeys(paths))
with open(sys.argv[1], "w") as pth:
    pth.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in unique) + "\n")
PY
