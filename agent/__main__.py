from agent.cli.commands import main

raise SystemExit(main())
