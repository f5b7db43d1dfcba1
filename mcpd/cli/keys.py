"""`mcpctl keys`: client keys for CURVE authentication.

    mcpctl keys generate NAME [--out DIR]   a key pair NAME.key / NAME.key_secret (0600); local only
    mcpctl keys allow [--] NAME KEY         KEY: the Z85 public key, or a NAME.key file (put -- first
                                            when the key begins with "-", as Z85 keys may)
    mcpctl keys revoke NAME
    mcpctl keys list [--json]               the server's public key and the allowed keys
    mcpctl keys api-add NAME                a new HTTP API key for tenant NAME (printed once, stored hashed)
    mcpctl keys api-revoke NAME             refuse NAME's HTTP API key from now on

allow, revoke and list go through the control socket and are privileged (the daemon's user,
root, or `security.admin_group`); the daemon writes its keys directory itself. A revoked key
cannot connect any more, and its open connections are refused from their next request on.
"""
from __future__ import annotations

from pathlib import Path

from mcpd.cli import control
from mcpd.cli.render import emit
from mcpd.security import keys


def register(sub, common) -> None:
    """Add the `keys` command to mcpctl's subparsers."""
    parser = sub.add_parser("keys", parents=[common],
                            help="CURVE keys (generate, allow, revoke, list) and HTTP API keys (api-add, api-revoke)")
    commands = parser.add_subparsers(dest="keys_command", required=True)
    generate = commands.add_parser("generate", help="make a client key pair (no daemon needed)")
    generate.add_argument("name", help="the key's name: the tenant its holder will be")
    generate.add_argument("--out", default=".", help="directory for NAME.key and NAME.key_secret (default .)")
    generate.set_defaults(handler=cmd_generate)
    allow = commands.add_parser("allow", parents=[common], help="let the holder of a public key connect as NAME")
    allow.add_argument("name")
    allow.add_argument("key", help="Z85 public key (40 characters) or a NAME.key file")
    revoke = commands.add_parser("revoke", parents=[common], help="refuse the key named NAME from now on")
    revoke.add_argument("name")
    listing = commands.add_parser("list", parents=[common], help="server public key and allowed client keys")
    api_add = commands.add_parser("api-add", parents=[common], help="a new HTTP API key for tenant NAME (shown once)")
    api_add.add_argument("name")
    api_revoke = commands.add_parser("api-revoke", parents=[common], help="refuse NAME's HTTP API key")
    api_revoke.add_argument("name")

    def remote(op: str, args_of, render):
        def handler(args) -> int:
            emit(args, control.call(args, op, args_of(args)), render)
            return control.EXIT_OK
        return handler
    allow.set_defaults(handler=remote("keys.allow", lambda a: {"name": a.name, "public_key": _public_key(a.key)},
                                      lambda r: f"allowed {r['allowed']}"))
    revoke.set_defaults(handler=remote("keys.revoke", lambda a: {"name": a.name},
                                       lambda r: "revoked" if r["revoked"] else "no key of that name"))
    listing.set_defaults(handler=remote("keys.list", lambda a: {}, _render_list))
    api_add.set_defaults(handler=remote("keys.api.add", lambda a: {"name": a.name}, lambda r: r["api_key"]))
    api_revoke.set_defaults(handler=remote("keys.api.revoke", lambda a: {"name": a.name},
                                           lambda r: "revoked" if r["revoked"] else "no API key of that name"))


def cmd_generate(args) -> int:
    public, _ = keys.generate(Path(args.out), args.name)
    print(f"{public}\nwrote {Path(args.out) / args.name}.key and .key_secret (keep the secret one private)")
    return 0


def _public_key(text: str) -> str:
    path = Path(text)
    return keys.read_public(path) if path.is_file() else keys.check_public_key(text)


def _render_list(result: dict) -> str:
    lines = [f"curve {'on' if result['curve'] else 'off'}   keys dir {result['keys_dir']}",
             f"server public key: {result['server_public_key'] or '(none yet)'}"]
    lines += [f"  {entry['name']:<24} {entry['public_key']}" for entry in result["allowed"]]
    return "\n".join(lines + [f"HTTP API keys: {', '.join(result.get('api_keys', [])) or '(none)'}"])
