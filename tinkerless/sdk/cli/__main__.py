from tinkerless.sdk.cli.main import main

raise SystemExit(main())
