"""`kvserve download URI --dest DIR`: fetch a model (hf://, s3://, file://) into DIR, which appears only when
complete and verified. The engine pod's init container runs exactly this; on failure it writes one line,
DOWNLOAD_FAILED_PREFIX + the reason, to the termination log, where the operator reads it (ModelReady=False,
reason DownloadFailed)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

HELP = "Download a model (hf://ORG/NAME[@REV], s3://BUCKET/PREFIX, file:///PATH) into --dest, atomically"
DOWNLOAD_FAILED_PREFIX = "kvserve: download failed: "  # operator/pod_health.py keeps an equal copy (a test checks)
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_TERMINATION_BYTES = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("uri", help="hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or file:///PATH")
    parser.add_argument("--revision", help="hf:// only: branch, tag or commit (default main)")
    parser.add_argument(
        "--dest",
        required=True,
        help="the model folder to create (its parent must be writable; locks and staging live beside it)",
    )
    parser.add_argument(
        "--no-weights", action="store_true", help="config and tokenizer files only (the router's init container)"
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors), not a model (spec.adapters)",
    )
    parser.add_argument(
        "--progress-interval", type=float, default=10.0, metavar="SECONDS", help="log progress this often"
    )
    parser.add_argument(
        "--termination-log",
        default=os.environ.get("KVSERVE_TERMINATION_LOG", DEFAULT_TERMINATION_LOG),
        help="where to write the one-line failure reason (Kubernetes' terminationMessagePath)",
    )


def _write_termination(path: str, message: str) -> None:
    try:
        with open(path, "w") as f:
            f.write((DOWNLOAD_FAILED_PREFIX + " ".join(message.split()))[:MAX_TERMINATION_BYTES] + "\n")
    except OSError:
        pass  # outside a pod the file usually is not there


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    from kvserve.runtime.sources import download, uri

    try:
        source = uri.parse(args.uri, args.revision, field="URI", revision_field="--revision")
        result = download.download(
            source,
            args.dest,
            progress_interval_s=args.progress_interval,
            weights=not args.no_weights,
            adapter=args.adapter,
        )
    except (uri.SourceError, uri.FetchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        _write_termination(args.termination_log, str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - the pod must still say why it failed
        logging.getLogger("kvserve.download").exception("download failed")
        _write_termination(args.termination_log, f"{type(exc).__name__}: {exc}")
        return 1
    print(f"{result.dest} ({result.num_files} files, {result.num_bytes} bytes, commit {result.commit})")
    return 0
