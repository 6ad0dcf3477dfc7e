"""Part of the base: what maintd accepts from others, and on what terms. JSON from untrusted parties
(`jsonsafe`), paths hooks and configs could be injected through (`pathtrust`, sshd's StrictModes) and token
files (`secretfile`). It imports no wing but `agent.model`.
"""
