"""For a device call's A/B (tools/h200_session_at.sh): given the result folder and NAME:ENV pairs, read the chat
Triton rung's TPOT p50 from ab_<NAME>_<round>/*.json for rounds 1 and 2, print a table, and print last the ENV of
the variant that beats the base (the first pair) by more than 1.5% in every round — the fastest such — or the
base's ENV."""

import glob
import json
import sys

root, pairs = sys.argv[1], [p.split(":", 1) for p in sys.argv[2:]]
tpot = {}
for name, _ in pairs:
    for rnd in (1, 2):
        files = glob.glob(f"{root}/ab_{name}_{rnd}/*.json")
        rows = [r for f in files for r in json.load(open(f))["results"] if r["step"] == "+triton_kernels"]
        if rows:
            tpot[name, rnd] = rows[0]["tpot_ms_p50"]
for name, _ in pairs:
    print(name, [tpot.get((name, r)) for r in (1, 2)])
base = pairs[0][0]
best, best_env = None, pairs[0][1]
for name, env in pairs[1:]:
    gains = [tpot[base, r] / tpot[name, r] - 1 for r in (1, 2) if (base, r) in tpot and (name, r) in tpot]
    if len(gains) == 2 and min(gains) > 0.015 and (best is None or min(gains) > best):
        best, best_env = min(gains), env
print(f"kept: {best_env} (smallest gain over the rounds {best})" if best else "kept: the base")
print(best_env)
