from agent.emulator.cli import main

raise SystemExit(main())
