"""`python -m jdp.examples`: the folder of the shipped examples and each one's first line."""
import ast
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def listing() -> list[str]:
    """One line per example: its file name and what it is (a script's docstring, a shell script's
    first comment), read without running it; the folder first."""
    lines = [f"jdp's examples are in {HERE}:"]
    for name in sorted(os.listdir(HERE)):
        path = os.path.join(HERE, name)
        if name.startswith("_") or not name.endswith((".py", ".sh")):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if name.endswith(".py"):
            about = (ast.get_docstring(ast.parse(text)) or next(
                line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))).splitlines()[0]
            run = f"python -m pytest {path}" if name.startswith("test_") else f"python -m jdp.examples.{name[:-3]}"
        else:
            about = next(line.lstrip("# ") for line in text.splitlines()[1:] if line.startswith("#"))
            run = f"bash {path}"
        lines.append(f"  {name:24} {about}\n  {'':24} {run}")
    return lines


if __name__ == "__main__":
    print("\n".join(listing()))
