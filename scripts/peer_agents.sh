#!/usr/bin/env bash
# Install the agent clients that drive tpserve's Responses and Messages APIs: Codex CLI
# (@openai/codex) and Claude Code (@anthropic-ai/claude-code), from npm.
#
#   scripts/peer_agents.sh [DIR]      (default: .peers/agents, or $TPSERVE_AGENTS_DIR)
#
# Both live in their own npm prefix in the ignored .peers/ folder (DIR/node_modules/.bin/codex and
# .../claude), never globally. tests/test_agent_clients.py runs them against a daemon
# (docs/agents.md). The versions are pinned so the tests see the same clients (this Claude Code
# still runs on Node 20; later ones need Node 22); a folder that already has them is left alone.
set -euo pipefail

CODEX_VERSION="0.171.0"
CLAUDE_VERSION="2.1.197"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout: peers live in its .peers/
DIR="${1:-${TPSERVE_AGENTS_DIR:-$ROOT/.peers/agents}}"
NPM="${NPM:-npm}"

installed() {  # the version of npm package $1 under DIR, or nothing
    node -e 'try { console.log(require(process.argv[1]).version) } catch (e) {}' \
        "$DIR/node_modules/$1/package.json" 2>/dev/null
}

if [ -x "$DIR/node_modules/.bin/codex" ] && [ -x "$DIR/node_modules/.bin/claude" ] && \
   [ "$(installed @openai/codex)" = "$CODEX_VERSION" ] && \
   [ "$(installed @anthropic-ai/claude-code)" = "$CLAUDE_VERSION" ]; then
    exit 0
fi
mkdir -p "$DIR"
"$NPM" install --prefix "$DIR" --no-audit --no-fund --loglevel=error \
    "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_VERSION"
"$DIR/node_modules/.bin/codex" --version > /dev/null
"$DIR/node_modules/.bin/claude" --version > /dev/null
echo "peers ready: $DIR/node_modules/.bin/codex (Codex CLI $CODEX_VERSION)," \
     "$DIR/node_modules/.bin/claude (Claude Code $CLAUDE_VERSION)"
