"""What `import egmla` costs beside transformers' own Llama modeling file, each in fresh interpreters, alternated.

    python benchmarks/model/import_time.py --repeats 5

Prints the median wall seconds of `import transformers.models.llama.modeling_llama`, of `import egmla`, of both in
one process (egmla's own share), and which top-level packages each loads.
"""

import argparse
import statistics
import subprocess
import sys

PROBE = """
import sys, time
start = time.perf_counter()
{statement}
print(time.perf_counter() - start)
print(sorted({{name.split('.')[0] for name in sys.modules if not name.startswith('_')}} & {{'accelerate', 'peft', 'triton', 'torch'}}))
"""
STATEMENTS = {
    "llama modeling": "import transformers.models.llama.modeling_llama",
    "egmla": "import egmla",
    "egmla after llama": "import transformers.models.llama.modeling_llama\nmiddle = time.perf_counter()\nimport egmla\nstart = middle",
}


def measure(statement: str) -> tuple[float, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(statement=statement)], capture_output=True, text=True, check=True
    )
    seconds, packages = done.stdout.split("\n")[:2]
    return float(seconds), packages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seconds = {name: [] for name in STATEMENTS}
    packages = {}
    for _ in range(args.repeats):  # alternated, so that a noisy moment touches every row alike
        for name, statement in STATEMENTS.items():
            elapsed, packages[name] = measure(statement)
            seconds[name].append(elapsed)
    print(f"{'import':<20} {'median s':>9}  heavy packages loaded")
    for name in STATEMENTS:
        print(f"{name:<20} {statistics.median(seconds[name]):>9.2f}  {packages[name]}")
    ratio = statistics.median(seconds["egmla"]) / statistics.median(seconds["llama modeling"])
    print(f"import egmla / import Llama modeling: {ratio:.2f}x")


if __name__ == "__main__":
    main()
