"""The face: the `maintd` command line. `commands` parses it and starts the daemon (`run`) or a client
command; `cliclient` talks to a running daemon, `clitext` and `cliviews` write its answers for people,
`cliwatch` is `maintd watch`, `demo` is `maintd demo`, `docgen` writes the README's generated reference.

May import: every wing. No wing imports this one.
"""
