"""Part of the base: what every wing needs of the network. Where an address is (`addresses`: loopback URLs, a
`listen` setting), HTTP-dates and Retry-After (`httpdates`), and the bounded client exchange with a peer,
Prometheus or a webhook endpoint (`boundedhttp`). It imports no wing but `agent.model`.
"""
