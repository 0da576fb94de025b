"""castspec models fetch | list: the embedded registry of pinned, sha256-checked weights."""

from __future__ import annotations


def register(sub) -> None:
    models = sub.add_parser("models", help="fetch and list the embedded models")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="download, verify and convert a registry model")
    fetch.add_argument("names", nargs="+")
    msub.add_parser("list", help="registry models and whether they are cached")

    models.set_defaults(run=run_models)


def run_models(args) -> None:
    from castspec import models

    if args.models_command == "fetch":
        for name in args.names:
            print(models.fetch(name))
    else:
        for row in models.list_models():
            state = row["path"] if row["fetched"] else "not fetched"
            print(f"{row['name']:22} {row['description']:60} {state}")
