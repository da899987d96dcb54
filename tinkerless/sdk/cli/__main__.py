from tinkerless.sdk.cli.commands import main

raise SystemExit(main())
