#!/usr/bin/python3
# /usr/bin/maintd from the .deb/.rpm: the system Python with the distribution's libraries.
import sys

from agent.cli.commands import main

sys.exit(main())
